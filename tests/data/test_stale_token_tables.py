"""Token tables that a killed run left in ``datasets``' temporary directory (a SIGKILL skips its deletion at exit)
are removed by the next tokenization; those of live processes are kept."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pl_lowprec.data import token_table
from pl_lowprec.data.records import Sample
from pl_lowprec.data.token_table import TABLE_PREFIX, remove_tables_of_dead_processes


def _waited_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_tables_of_dead_processes_are_removed_with_their_empty_directory(tmp_path):
    dead, live = tmp_path / "hf_datasets-dead", tmp_path / "hf_datasets-live"
    shared = tmp_path / "hf_datasets-shared"
    for directory in (dead, live, shared):
        directory.mkdir()
    gone = _waited_pid()
    stale = dead / f"{TABLE_PREFIX}{gone}-abc.arrow"
    kept = live / f"{TABLE_PREFIX}{os.getpid()}-abc.arrow"
    beside = shared / f"{TABLE_PREFIX}{gone}-def.arrow"
    others = shared / "cache-1234.arrow"  # not this package's: kept, and so is its directory
    old_name = live / f"{TABLE_PREFIX}0123abcd.arrow"  # no process id: cannot be told, kept
    for path in (stale, kept, beside, others, old_name):
        path.write_bytes(b"rows")
    removed = remove_tables_of_dead_processes(str(tmp_path))
    assert sorted(removed) == sorted([str(stale), str(beside)])
    assert not dead.exists() and kept.exists() and old_name.exists() and others.exists()


def test_a_table_is_named_for_its_process_and_kept_while_it_runs(monkeypatch):
    datasets = pytest.importorskip("datasets")
    swept = []
    monkeypatch.setattr(token_table, "remove_tables_of_dead_processes", lambda: swept.append(True))
    rows = datasets.Dataset.from_list([{"text": f"row {i}"} for i in range(3)])
    table = token_table.tokenize(rows, lambda records: ([Sample([1, 2], [1, 2]) for _ in records], []), "rows")
    path = Path(table.cache_files[0]["filename"])
    assert path.name.startswith(f"{TABLE_PREFIX}{os.getpid()}-") and path.parent.name.startswith("hf_datasets-")
    assert str(path) not in remove_tables_of_dead_processes(str(path.parents[1]))
    assert path.exists() and len(table) == 3
    assert swept == [True]  # each tokenization first removes what killed runs left
