"""run_goals: every script in a process of its own, one at a time, its GOAL lines gathered into one table;
a script that fails, times out or prints no GOAL line is an ERROR and makes the run exit 1, a MISS does not.
The scripts here are small stand-ins written for the test, so the runner itself is what runs."""

from __future__ import annotations

import json
import textwrap

import pytest
from hypothesis import given, strategies as st

from agentlog.tools.bench import run_goals
from agentlog.tools.bench.goals import goal_line, parse_goal_line

SCRIPTS = {
    "bench_ok.py": '''
        import argparse
        p = argparse.ArgumentParser()
        p.add_argument("--quick", action="store_true")
        quick = p.parse_args().quick
        print("a table row")
        print("GOAL ok_ratio: 1.20x (goal <= 1.5x) PASS")
        print(f"GOAL ok_rate: 12 ev/s ({'quick' if quick else 'full'} run) (goal >= 20 ev/s) MISS  [anchor 40 ev/s]")
    ''',
    "bench_fails.py": '''
        import sys
        print("GOAL half_done: 1.00x (goal <= 2x) PASS")
        print("Traceback: something broke", file=sys.stderr)
        sys.exit(3)
    ''',
    "bench_silent.py": '''
        print("a table, and no goal")
    ''',
    "bench_slow.py": '''
        import time
        print("started", flush=True)
        time.sleep(60)
    ''',
}


@pytest.fixture()
def bench_dir(tmp_path):
    for name, body in SCRIPTS.items():
        (tmp_path / name).write_text(textwrap.dedent(body))
    return tmp_path


def test_every_script_runs_and_each_failure_is_an_error_that_fails_the_run(bench_dir, tmp_path, capsys):
    out_json = tmp_path / "goals.json"
    code = run_goals.main(["--dir", str(bench_dir), "--timeout", "3", "--json", str(out_json)])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    rows = [line.split() for line in out if line.startswith("bench_")]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("bench_fails.py", "half_done", "PASS"), ("bench_ok.py", "ok_ratio", "PASS"), ("bench_ok.py", "ok_rate", "MISS")]
    errors = {line.split(":", 1)[0]: line for line in out if line.startswith("ERROR ")}
    assert set(errors) == {"ERROR bench_fails.py", "ERROR bench_silent.py", "ERROR bench_slow.py"}
    assert "exit status 3" in errors["ERROR bench_fails.py"] and "something broke" in errors["ERROR bench_fails.py"]
    assert "no GOAL line" in errors["ERROR bench_silent.py"] and "a table, and no goal" in errors["ERROR bench_silent.py"]
    assert "timed out after 3 s" in errors["ERROR bench_slow.py"] and "started" in errors["ERROR bench_slow.py"]
    saved = json.loads(out_json.read_text())
    ok = next(r for r in saved["results"] if r["script"] == "bench_ok.py")
    assert ok["error"] is None and ok["goals"][1] == {"name": "ok_rate", "measured": "12 ev/s (full run)", "op": ">=",
                                                      "target": "20 ev/s", "passed": False, "after": "[anchor 40 ev/s]"}


def test_a_miss_alone_exits_0_and_quick_reaches_the_scripts_that_take_it(bench_dir, capsys):
    assert run_goals.main(["--dir", str(bench_dir), "--only", "bench_ok", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "12 ev/s (quick run)" in out and "ERROR" not in out


def test_skip_leaves_scripts_out_and_an_unknown_name_is_refused(bench_dir, capsys):
    assert run_goals.main(["--dir", str(bench_dir), "--skip", "bench_fails.py", "bench_silent", "bench_slow"]) == 0
    assert run_goals.main(["--dir", str(bench_dir), "--only", "bench_nope"]) == 2
    assert "no such script" in capsys.readouterr().err


def test_an_information_only_script_owes_no_goal_line_and_runs_only_when_named(bench_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_goals, "INFORMATION_ONLY", {"bench_silent.py"})
    assert run_goals.main(["--dir", str(bench_dir), "--only", "bench_silent"]) == 0
    assert "ERROR" not in capsys.readouterr().out
    ran = tmp_path / "ran.json"
    assert run_goals.main(["--dir", str(bench_dir), "--skip", "bench_fails", "bench_slow", "--json", str(ran)]) == 0
    assert [r["script"] for r in json.loads(ran.read_text())["results"]] == ["bench_ok.py"]


def test_the_information_only_script_is_left_out_unless_named():
    names = {s.name for s in run_goals.scripts_in(run_goals.HERE)}
    assert run_goals.INFORMATION_ONLY <= names  # the set names scripts that exist
    assert "goals.py" not in names and "run_goals.py" not in names and "bench_engine.py" in names


def test_against_an_earlier_run_lists_each_verdict_that_changed_and_each_goal_one_run_lacks(bench_dir, tmp_path, capsys):
    def goal(name, measured, passed):
        return {"name": name, "measured": measured, "op": "<=", "target": "1.5x", "passed": passed, "after": ""}

    before = tmp_path / "before.json"
    before.write_text(json.dumps({"quick": False, "results": [
        {"script": "bench_ok.py", "seconds": 1.0, "error": None,
         "goals": [goal("ok_ratio", "1.70x", False), goal("ok_rate", "11 ev/s (full run)", False), goal("ok_gone", "1.00x", True)]},
        {"script": "bench_not_run_now.py", "seconds": 1.0, "error": None, "goals": [goal("elsewhere", "9x", False)]},
    ]}))
    assert run_goals.main(["--dir", str(bench_dir), "--only", "bench_ok", "--against", str(before)]) == 0  # information
    out = capsys.readouterr().out.splitlines()
    since = out.index(f"since {before}: 2 change(s)")
    assert out[since + 1:] == [
        "GONE bench_ok.py ok_gone: printed no longer (was PASS, 1.00x)",
        "CHANGED bench_ok.py ok_ratio: MISS -> PASS (1.70x -> 1.20x, goal <= 1.5x)",
    ]
    assert run_goals.main(["--dir", str(bench_dir), "--only", "bench_ok", "--quick", "--against", str(before)]) == 0
    assert "was a full run and this one is --quick: its verdicts came at other sizes" in capsys.readouterr().err


def test_against_a_file_that_is_not_an_earlier_run_is_refused(bench_dir, tmp_path, capsys):
    for text in ("not json", '{"results": 3}', "[1, 2]"):
        (tmp_path / "bad.json").write_text(text)
        assert run_goals.main(["--dir", str(bench_dir), "--only", "bench_ok", "--against", str(tmp_path / "bad.json")]) == 2
        assert "--against" in capsys.readouterr().err


def test_history_keeps_each_run_and_compares_it_with_the_newest_earlier_run_of_its_kind(bench_dir, tmp_path, capsys):
    history = tmp_path / "history"

    def run(*extra: str) -> tuple[list[str], str]:
        assert run_goals.main(["--dir", str(bench_dir), "--only", "bench_ok", "--history", str(history), *extra]) == 0
        captured = capsys.readouterr()
        return captured.out.splitlines(), captured.err

    out, err = run()
    assert "no earlier full run of these scripts in" in err and not any(line.startswith("since ") for line in out)
    first = sorted(history.iterdir())
    assert len(first) == 1 and out[-1] == f"kept in {first[0]}"
    kept = json.loads(first[0].read_text())
    assert kept["quick"] is False and kept["started"].endswith("+00:00") and "cores" in kept["machine"]
    assert [g["name"] for g in kept["results"][0]["goals"]] == ["ok_ratio", "ok_rate"]

    # A quick run is compared with quick runs only: the full one above is not its kind.
    out, err = run("--quick")
    assert "no earlier --quick run of these scripts in" in err
    # The newest full run is the one compared with: make it say ok_ratio missed, and the next run lists the flip.
    kept["results"][0]["goals"][0].update(measured="1.70x", passed=False)
    kept["machine"] = "another host, 64 cores"
    first[0].write_text(json.dumps(kept))
    out, err = run()
    assert f"{first[0]} ran on another machine (another host, 64 cores)" in err
    assert out[out.index(f"since {first[0]}: 1 change(s)") + 1] == \
        "CHANGED bench_ok.py ok_ratio: MISS -> PASS (1.70x -> 1.20x, goal <= 1.5x)"
    runs = sorted(history.iterdir())
    assert len(runs) == 3 and [p.name.endswith("-quick.json") for p in runs] == [False, True, False]
    out, _ = run()
    assert f"since {runs[2]}: no verdict changed" in out  # the newest full run, not the first


def test_history_skips_a_torn_run_and_a_run_of_other_scripts_for_the_newest_that_covers_this_one(bench_dir, tmp_path, capsys):
    history = tmp_path / "history"
    assert run_goals.main(["--dir", str(bench_dir), "--only", "bench_ok", "--history", str(history)]) == 0
    (good,) = history.iterdir()
    # Newer than it: a run of another script only, and a run torn mid-write.
    (history / "goals-29990101-000000.000000.json").write_text(json.dumps(
        {"quick": False, "results": [{"script": "bench_other.py", "seconds": 1.0, "error": None, "goals": []}]}))
    (history / "goals-29990101-000001.000000.json").write_text('{"quick": false, "resul')
    (history / "goals-latest.json").write_text("{}")  # not a name the history gives: never read
    capsys.readouterr()
    assert run_goals.main(["--dir", str(bench_dir), "--only", "bench_ok", "--history", str(history)]) == 0
    captured = capsys.readouterr()
    assert "skipping goals-29990101-000001.000000.json: cannot read it as JSON" in captured.err
    assert "goals-latest" not in captured.err
    assert f"since {good}: no verdict changed" in captured.out.splitlines()


def test_history_that_cannot_be_a_folder_is_refused_before_any_benchmark_runs(bench_dir, tmp_path, capsys):
    not_a_folder = tmp_path / "a_file"
    not_a_folder.write_text("")
    assert run_goals.main(["--dir", str(bench_dir), "--only", "bench_ok", "--history", str(not_a_folder)]) == 2
    captured = capsys.readouterr()
    assert f"--history {not_a_folder}: cannot use it as a folder" in captured.err and "bench_ok.py" not in captured.out


def test_history_with_against_compares_with_the_file_named(bench_dir, tmp_path, capsys):
    before = tmp_path / "before.json"
    before.write_text(json.dumps({"quick": False, "results": []}))
    history = tmp_path / "history"
    history.mkdir()
    (history / "goals-20260101-000000.000000.json").write_text("not json: never read, --against wins")
    assert run_goals.main(["--dir", str(bench_dir), "--only", "bench_ok", "--history", str(history),
                           "--against", str(before)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"since {before}: 2 change(s)" in out and len(list(history.iterdir())) == 2


_TEXT = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=30).map(str.strip).filter(bool)


@given(name=st.from_regex(r"[a-z][a-z0-9_.]{0,30}", fullmatch=True), measured=_TEXT, op=st.sampled_from([">=", "<=", "<", ">", "=="]),
       target=_TEXT.filter(lambda t: ")" not in t), ok=st.booleans())
def test_a_written_goal_line_reads_back_as_written(name, measured, op, target, ok):
    line = goal_line(name, measured, op, target, ok)
    back = parse_goal_line(line)
    assert back is not None and (back.name, back.op, back.target, back.passed) == (name, op, target, ok)
    assert back.measured == measured or " (goal " in measured  # a measure that itself holds " (goal " is ambiguous


def test_a_line_that_is_not_a_goal_reads_as_none():
    assert parse_goal_line("  round 1/5: raw 2.97 s") is None
    assert parse_goal_line("GOAL broken: 1.0x (goal ~ 2x) PASS") is None
