"""A worker's checkpoint parts: slices of the flat state that load back whole on any count."""

from __future__ import annotations

import pytest
import torch

from workers.checkpoint.manifest import CheckpointCorrupt, verify_checkpoint, write_manifest
from workers.checkpoint.parts import part_range, take_snapshot, write_snapshot
from workers.checkpoint.reading import load_residuals, load_state
from workers.checkpoint.storage import CheckpointStorage


@pytest.mark.parametrize(("numel", "count"), [(10, 3), (7, 7), (3, 5), (1000, 4)])
def test_parts_tile_the_flat_tensor(numel, count):
    ranges = [part_range(numel, i, count) for i in range(count)]
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(hi - lo for lo, hi in ranges) - min(hi - lo for lo, hi in ranges) <= 1


def _checkpoint(tmp_path, count: int):
    storage = CheckpointStorage(str(tmp_path))
    flat = {"params": torch.randn(1001), "optim/exp_avg": torch.randn(1001)}
    whole = {"optim/step": torch.tensor(7.0), "buffer/running_mean": torch.randn(4)}
    files = []
    for index in range(count):
        residuals = {(0, 1001): torch.full((1001,), float(index))}
        part = take_snapshot(7, index, count, flat, whole, residuals)
        files += write_snapshot(storage, "step-00000007", "a1", index, part)
    write_manifest(storage, 7, files, {})
    return storage, flat, whole


def test_a_checkpoint_written_in_parts_loads_back_whole(tmp_path):
    storage, flat, whole = _checkpoint(tmp_path, count=3)
    manifest = verify_checkpoint(storage, "step-00000007")
    got_flat, got_whole = load_state(storage, "step-00000007", manifest)
    assert got_flat.keys() == flat.keys() and got_whole.keys() == whole.keys()
    for key in flat:
        torch.testing.assert_close(got_flat[key], flat[key], rtol=0, atol=0)
    for key in whole:
        torch.testing.assert_close(got_whole[key], whole[key], rtol=0, atol=0)
    assert torch.equal(load_residuals(storage, "step-00000007", manifest, 2)[(0, 1001)], torch.full((1001,), 2.0))
    assert load_residuals(storage, "step-00000007", manifest, 5) == {}


def test_a_part_changed_after_verification_is_refused(tmp_path):
    storage, _, _ = _checkpoint(tmp_path, count=2)
    manifest = verify_checkpoint(storage, "step-00000007")
    part = tmp_path / "step-00000007" / "part-00001-of-00002-a1.pt"
    part.write_bytes(part.read_bytes()[:-10])
    with pytest.raises(CheckpointCorrupt, match="part-00001-of-00002-a1.pt"):
        load_state(storage, "step-00000007", manifest)


def test_a_manifest_listing_one_part_twice_is_refused(tmp_path):
    storage = CheckpointStorage(str(tmp_path))
    flat = {"params": torch.randn(1000)}
    files = []
    for tag in ("a1", "a2"):  # part 0 of 2, twice (two attempts); part 1 missing
        files += write_snapshot(storage, "step-00000007", tag, 0, take_snapshot(7, 0, 2, flat, {}, {}))
    write_manifest(storage, 7, files, {})
    manifest = verify_checkpoint(storage, "step-00000007")
    with pytest.raises(CheckpointCorrupt, match="part 0 is listed twice"):
        load_state(storage, "step-00000007", manifest)


def test_a_tensor_file_holds_any_dtype_and_shape_and_refuses_a_header_that_lies():
    import json

    from workers.checkpoint.tensor_file import ALIGN, MAGIC, decode, encode

    tensors = {
        "a": torch.arange(10, dtype=torch.float32).reshape(2, 5).t(),  # not contiguous
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "c": torch.tensor(7, dtype=torch.int64),  # 0-dim
        "d": torch.zeros(0, 3),
        "e": torch.tensor([True, False, True]),
        "f": torch.randint(0, 255, (5000,), dtype=torch.uint8),
        "g": torch.randn(3, dtype=torch.complex64).conj(),  # a rotary table's dtype, as a lazy conjugate
        "h": -torch.randn(2, dtype=torch.complex128).conj().imag,  # a lazy negation
        "i": torch.tensor([1, 2], dtype=torch.uint16),
    }
    steps = {f"step{i}": torch.tensor(float(i)) for i in range(1000)}  # small tensors pack, unpadded
    assert len(encode({}, steps)) < 64 * ALIGN  # its header mostly (a page each: 250)
    laid_out = encode({"step": 3, "name": "x"}, tensors)
    assert len(laid_out) % ALIGN == 0
    meta, got = decode(bytes(laid_out))
    assert meta == {"step": 3, "name": "x"} and got.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor.resolve_conj().resolve_neg()), key

    def lying(**change: object) -> bytes:
        entry = {"name": "x", "dtype": "torch.float32", "shape": [2], "offset": 0, "bytes": 8, **change}
        header = json.dumps({"meta": {}, "tensors": [entry] * (2 if change.get("twice") else 1)}).encode()
        return MAGIC + len(header).to_bytes(8, "little") + header + bytes(4096)

    for change in ({"shape": [2, -2]}, {"shape": [-1], "bytes": -1, "dtype": "torch.uint8"}, {"offset": -64},
                   {"offset": 10**400}, {"shape": [2**62, 2**62]}, {"dtype": "torch.nn"}, {"dtype": "os.system"},
                   {"shape": "2"}, {"twice": True}):
        with pytest.raises(ValueError):
            decode(lying(**change))
    with pytest.raises(ValueError, match="no magic"):
        decode(b"PK\x03\x04" + bytes(100))
    broken = bytearray(laid_out)
    broken[20:40] = b"x" * 20  # inside the JSON header
    with pytest.raises(ValueError, match="header"):
        decode(bytes(broken))


def test_a_checkpoint_of_torch_save_parts_written_before_tensor_files_still_loads(tmp_path):
    import hashlib
    import io

    from jobspec.wire import FileEntry

    storage = CheckpointStorage(str(tmp_path))
    flat = {"params": torch.arange(6.0)}
    entries = []
    for index in range(2):
        lo, hi = part_range(6, index, 2)
        payload = {"format": 1, "step": 4, "index": index, "count": 2, "numel": 6, "slices": {"params": flat["params"][lo:hi].clone()},
                   "whole": {"rng/torch": torch.get_rng_state()} if index == 0 else {}}
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = buffer.getvalue()
        path = f"part-{index:05d}-of-00002-a1.pt"
        storage.write_bytes(f"step-00000004/{path}", data)
        entries.append(FileEntry(path, hashlib.sha256(data).hexdigest(), len(data)))
    write_manifest(storage, 4, entries, {})
    got_flat, got_whole = load_state(storage, "step-00000004", verify_checkpoint(storage, "step-00000004"))
    assert torch.equal(got_flat["params"], flat["params"]) and "rng/torch" in got_whole


def test_a_tensor_file_that_does_not_read_is_refused_as_corrupt(tmp_path):
    import hashlib

    from jobspec.wire import FileEntry
    from workers.checkpoint.tensor_file import MAGIC

    storage = CheckpointStorage(str(tmp_path))
    data = MAGIC + (10**6).to_bytes(8, "little") + b"{}"
    storage.write_bytes("step-00000002/part-00000-of-00001-a1.pt", data)
    write_manifest(storage, 2, [FileEntry("part-00000-of-00001-a1.pt", hashlib.sha256(data).hexdigest(), len(data))], {})
    with pytest.raises(CheckpointCorrupt, match="not a readable part: its header claims"):
        load_state(storage, "step-00000002", verify_checkpoint(storage, "step-00000002"))


@pytest.mark.parametrize("refused", [False, True])
def test_a_part_is_written_past_the_page_cache_where_the_file_system_takes_it(tmp_path, monkeypatch, refused):
    """A checkpoint's part goes out through ``write_direct``, which asks for O_DIRECT; a file
    system that refuses it (EINVAL at the write: tmpfs before Linux 6.6, some network ones)
    gets the bytes through the page cache. Either way the file holds exactly the bytes."""
    import errno
    import fcntl
    import os

    from workers.checkpoint import storage as checkpoint_storage

    write, tried = os.write, []

    def spying(fd: int, data: object) -> int:
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        tried.append(direct)
        if direct and refused:
            raise OSError(errno.EINVAL, "direct I/O refused")
        return write(fd, data)

    monkeypatch.setattr(checkpoint_storage.os, "write", spying)
    storage, flat, _ = _checkpoint(tmp_path, count=2)
    monkeypatch.undo()
    assert tried and tried[0]  # asked for direct I/O (and this file system takes it, or not)
    assert not refused or all(t is False for t in tried[1::2])  # each refusal: then through the cache
    got_flat, _ = load_state(storage, "step-00000007", verify_checkpoint(storage, "step-00000007"))
    assert all(torch.equal(got_flat[k], flat[k]) for k in flat)


def test_a_thread_reuses_its_buffer_and_an_earlier_files_bytes_never_show_in_a_later_one():
    from workers.checkpoint.tensor_file import decode, encode

    big = bytes(encode({"n": 1}, {"x": torch.full((5000,), 7.0)}))
    small = encode({"n": 2}, {"y": torch.ones(10)})
    # Past its own bytes only zeros: the padding, none of the earlier file's 7s.
    assert len(small) < len(big) and torch.tensor(7.0).numpy().tobytes() not in bytes(small)
    assert decode(bytes(small))[0] == {"n": 2}
    bigger = encode({"n": 3}, {"z": torch.arange(20000.0)})
    assert torch.equal(decode(bytes(bigger))[1]["z"], torch.arange(20000.0))


def test_a_span_reads_from_the_parts_that_hold_it_into_any_dtype_and_layout(tmp_path):
    from workers.checkpoint.reading import open_checkpoint

    storage, flat, whole = _checkpoint(tmp_path, count=3)  # parts [0, 334), [334, 668), [668, 1001)
    saved = open_checkpoint(storage, "step-00000007", verify_checkpoint(storage, "step-00000007"))
    assert saved.numel == 1001 and saved.flat.keys() == flat.keys() and saved.read_whole().keys() == whole.keys()
    straight = torch.empty(400)
    saved.flat["params"].read(300, 700, straight)  # across all three parts
    assert torch.equal(straight, flat["params"][300:700])
    cast = torch.empty(2, 400, dtype=torch.float64)[:, 0]  # strided, another dtype: through host memory
    saved.flat["optim/exp_avg"].read(333, 335, cast)
    assert torch.equal(cast, flat["optim/exp_avg"][333:335].double())
    with pytest.raises(ValueError, match="do not fit"):
        saved.flat["params"].read(1000, 1002, torch.empty(2))
