"""Durable files (``jobspec/durable.py``): a write is whole or absent, private unless shared,
and a shared file gets the mode a new file would (the umask read without setting it)."""

from __future__ import annotations

import os
import stat

import pytest

from jobspec import durable


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    durable.process_umask.cache_clear()
    yield
    os.umask(old)
    durable.process_umask.cache_clear()


def test_a_write_is_private_unless_shared_and_then_follows_the_umask(tmp_path, umask_027):
    durable.write_atomic(tmp_path / "private", lambda f: f.write(b"a"))
    durable.write_atomic(tmp_path / "shared", lambda f: f.write(b"b"), shared=True)
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o640
    assert os.umask(0o027) == 0o027  # reading it left it as it was


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "state.json"
    durable.write_atomic(target, lambda f: f.write(b"old"))

    def broken(handle) -> None:
        handle.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        durable.write_atomic(target, broken)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_json_lines_skip_a_last_line_cut_short_but_name_a_bad_one_before(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"a": 1}\n{"b": 2}\n{"c":')
    assert durable.read_jsonl(path) == [{"a": 1}, {"b": 2}]
    path.write_text('{"a": 1}\nnot json\n{"c": 3}\n')
    with pytest.raises(ValueError, match="events.jsonl: line 2 is not JSON"):
        durable.read_jsonl(path)
    assert durable.read_jsonl(tmp_path / "missing.jsonl") == []
