"""The one home of atomic file writes (events/fs.py): a reader sees the old
content or the new, never a part, and a failed write leaves no temp file."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentlog.events.fs import atomic_file, atomic_path, write_atomic, write_dir_atomically


def test_atomic_file_replaces_the_content_and_leaves_only_the_file(tmp_path: Path) -> None:
    target = tmp_path / "config.json"
    target.write_text("old\n")
    with atomic_file(target, "w", encoding="utf-8") as f:
        f.write("new\n")
        assert target.read_text() == "old\n"  # not visible before the block ends
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_a_failing_block_keeps_the_old_content_and_removes_its_temp(tmp_path: Path) -> None:
    target = tmp_path / "policy.pt"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="half way"):
        with atomic_file(target) as f:
            f.write(b"partial")
            raise RuntimeError("half way")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.pt"]


def test_a_failing_rename_removes_the_temp(tmp_path: Path) -> None:
    (tmp_path / "INDEX").mkdir()  # a directory in the file's place: the rename fails
    with pytest.raises(IsADirectoryError):
        write_atomic(tmp_path, "INDEX", b"x" * 4096)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["INDEX"]


def test_atomic_path_replaces_a_symlink_and_removes_a_stale_temp(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    link = tmp_path / "latest"
    link.symlink_to("a")
    (tmp_path / ".latest.tmp").write_text("stale")  # left by a crashed writer: removed before the block
    with atomic_path(link, tmp_name=".latest.tmp") as tmp:
        assert not tmp.exists()
        tmp.symlink_to("b")
    assert link.resolve() == (tmp_path / "b").resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "latest"]


def test_write_dir_atomically_keeps_a_finished_directory_unless_told_to_replace(tmp_path: Path) -> None:
    target = tmp_path / "model"

    def build(content: str):
        def write(tmp: Path) -> None:
            tmp.mkdir()
            (tmp / "weights").write_text(content)
        return write

    write_dir_atomically(target, build("first"), replace=False)
    write_dir_atomically(target, build("second"), replace=False)
    assert (target / "weights").read_text() == "first"
    write_dir_atomically(target, build("third"), replace=True)
    assert (target / "weights").read_text() == "third"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
