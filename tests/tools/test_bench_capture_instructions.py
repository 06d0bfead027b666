"""The capture's instruction-count benchmark: its window brackets exactly the timed rounds'
capture (the helper's calls do nothing outside valgrind), and, under valgrind (slow), it
counts instructions inside the windows only."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from agentlog.tools.bench import bench_capture_instructions as bench

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
needs_helper = pytest.mark.skipif(shutil.which("cc") is None or not Path("/usr/include/valgrind/callgrind.h").exists(),
                                  reason="needs a C compiler and valgrind/callgrind.h (apt-get install valgrind)")


@needs_helper
def test_the_window_brackets_each_timed_round_and_nothing_else(tmp_path, monkeypatch):
    library = bench.build_window(tmp_path)
    calls: list[str] = []
    start, stop = bench.Window.start, bench.Window.stop

    def counting_start(self):
        assert not calls or calls[-1] == "stop", "a window opened inside another"
        calls.append("start")
        start(self)

    def counting_stop(self):
        assert calls and calls[-1] == "start", "a window closed that was not open"
        calls.append("stop")
        stop(self)

    monkeypatch.setattr(bench.Window, "start", counting_start)
    monkeypatch.setattr(bench.Window, "stop", counting_stop)
    assert bench.run_child(library, 600, 3, 2) == 2
    assert calls == ["start", "stop"] * 2  # the growing rounds before them are not counted


@needs_compiler
def test_a_broken_compiler_is_named_with_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "_WINDOW_C", "#include <no/such_header.h>\n")
    with pytest.raises(RuntimeError, match=r"compiling the window helper .* failed \(needs valgrind/callgrind.h"):
        bench.build_window(tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
def test_it_counts_the_windows_of_a_tiny_run_and_ends_with_its_information_line(capsys):
    assert bench.main(["--context", "600", "--sessions", "3", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"^instructions a captured turn \(all threads, inside the timed window\): ([\d,]+) \(([\d,]+) over 6 turns\)$", out, re.M)
    assert found, out
    assert 10_000 < int(found.group(1).replace(",", "")) < 10_000_000  # a turn's capture: not the growing rounds' encoding
    assert out.rstrip().splitlines()[-1].startswith("information: ")
