"""A snapshot store directory that holds something else than a store is refused with a
SnapshotError naming the path and what was expected, never a raw OSError; a stray
directory in the store's tmp/ does not break collection (nothing live is removed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentlog.engine import SnapshotError, SnapshotStore


def _store_with_one_snapshot(tmp_path: Path) -> tuple[SnapshotStore, str]:
    """A store holding one live snapshot (session s1's turn 0), and its digest."""
    store = SnapshotStore(tmp_path / "store")
    work = tmp_path / "w"
    work.mkdir()
    (work / "a").write_text("a")
    return store, store.snapshot(work, "s1", turn_index=0).digest


def test_a_store_root_that_is_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    f = tmp_path / "notastore"
    f.write_text("my notes\n")
    with pytest.raises(SnapshotError, match="notastore"):
        SnapshotStore(f)
    assert f.read_text() == "my notes\n"


def test_a_store_whose_refs_is_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    (root / "refs").write_text("not a directory")
    with pytest.raises(SnapshotError, match=r"refs.*expected a directory"):
        SnapshotStore(root)
    assert (root / "refs").read_text() == "not a directory"


def test_a_directory_among_the_refs_is_named_and_nothing_live_is_lost(tmp_path: Path) -> None:
    store, digest = _store_with_one_snapshot(tmp_path)
    (store.root / "refs" / "junk").mkdir()
    with pytest.raises(SnapshotError, match="junk"):
        store.refs()
    with pytest.raises(SnapshotError, match="junk"):
        store.collect()
    assert store.has(digest)  # the live snapshot is still there


def test_a_stale_directory_in_tmp_does_not_break_collection(tmp_path: Path) -> None:
    store, digest = _store_with_one_snapshot(tmp_path)
    stray = store.root / "tmp" / "somebodys-dir"
    stray.mkdir()
    (stray / "f").write_text("keep me")
    os.utime(stray, (0, 0))  # older than STALE_TMP_S
    store.collect()  # before the fix: IsADirectoryError from the tmp sweep
    assert store.has(digest) and (stray / "f").read_text() == "keep me"
