"""One file's bytes (``workers/checkpoint/file_io.py``): a direct write that lands every byte
(through the page cache where the file system refuses O_DIRECT), a hash taken as the bytes go
out that equals the file's, ranged reads that fill a buffer or say where the file ended, and
directories made with their parents fsynced."""

from __future__ import annotations

import hashlib
import io
import mmap
import os

import pytest

from workers.checkpoint import file_io
from workers.checkpoint.file_io import HashingWriter, RangedReader, makedirs_durable, write_direct


def _aligned(nbytes: int) -> mmap.mmap:
    """A page-aligned buffer of ``nbytes`` (a multiple of the page size), as a direct write needs."""
    buffer = mmap.mmap(-1, nbytes)
    buffer.write(bytes(range(256)) * (nbytes // 256))
    return buffer


def test_a_direct_write_lands_every_byte_wherever_the_file_system_takes_it(tmp_path):
    data = _aligned(4 * mmap.PAGESIZE)
    fd = os.open(tmp_path / "part", os.O_WRONLY | os.O_CREAT)
    try:
        direct = write_direct(fd, memoryview(data))
    finally:
        os.close(fd)
    assert isinstance(direct, bool)  # False on tmpfs, which refuses O_DIRECT
    assert (tmp_path / "part").read_bytes() == bytes(data)


def test_a_refused_direct_write_goes_through_the_page_cache(tmp_path, monkeypatch):
    # A file system that accepts the flag and then refuses the write (EINVAL) is written anyway.
    real_write = os.write
    refused = []

    def write(fd: int, data: memoryview) -> int:
        if not refused:
            refused.append(True)
            raise OSError(22, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(file_io.os, "write", write)
    data = _aligned(mmap.PAGESIZE)
    fd = os.open(tmp_path / "part", os.O_WRONLY | os.O_CREAT)
    try:
        direct = write_direct(fd, memoryview(data))
    finally:
        os.close(fd)
    assert refused and direct is False and (tmp_path / "part").read_bytes() == bytes(data)


def test_the_hash_taken_as_the_bytes_go_out_is_the_files():
    raw = io.BytesIO()
    writer = HashingWriter(raw)
    for chunk in (b"step-", memoryview(b"00000040"), bytearray(b"\x00" * 1000)):
        writer.write(chunk)
    assert writer.hexdigest() == hashlib.sha256(raw.getvalue()).hexdigest()
    assert writer.tell() == writer.size == len(raw.getvalue()) == 1013
    assert not writer.seekable()  # seeking back would make the running hash wrong


def test_a_ranged_read_fills_the_buffer_from_the_offset_and_names_the_file_where_it_ends(tmp_path):
    path = tmp_path / "part"
    path.write_bytes(bytes(range(100)))
    with open(path, "rb", buffering=0) as handle:
        reader = RangedReader(handle, 100, str(path))
        assert reader.read(10, 5) == bytes(range(10, 15))
        into = bytearray(3)
        reader.read_into(97, memoryview(into))
        assert into == bytes([97, 98, 99])
        with pytest.raises(EOFError, match=f"{path}: 8 bytes wanted at 96, the file ends after 4"):
            reader.read(96, 8)


def test_directories_are_made_with_every_parent_they_add_to_fsynced(tmp_path, monkeypatch):
    synced: list[str] = []
    monkeypatch.setattr(file_io, "fsync_dir", lambda directory: synced.append(str(directory)))
    makedirs_durable(str(tmp_path / "a" / "b" / "c"))
    assert (tmp_path / "a" / "b" / "c").is_dir()
    assert synced == [str(tmp_path), str(tmp_path / "a"), str(tmp_path / "a" / "b")]
    makedirs_durable(str(tmp_path / "a" / "b" / "c"))  # already there: nothing to make or sync
    assert len(synced) == 3
