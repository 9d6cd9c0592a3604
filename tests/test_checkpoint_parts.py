"""A worker's checkpoint parts: slices of the flat state that load back whole on any count."""

from __future__ import annotations

import pytest
import torch

from workers.checkpoint_manifest import CheckpointCorrupt, verify_checkpoint, write_manifest
from workers.checkpoint_storage import CheckpointStorage
from workers.checkpointing import load_residuals, load_state, part_range, take_snapshot, write_snapshot


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
