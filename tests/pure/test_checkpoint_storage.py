"""Checkpoint storage: atomic writes, manifests, verification, fallback and pruning.

Most tests run on three roots: a plain local path, a ``file://`` URI (also the local code
path), and ``mock://``, which goes through ``pyarrow.fs.FileSystem.from_uri`` like ``s3://``
does, so the remote code path runs for real against pyarrow's in-memory filesystem.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import pytest

from jobspec.wire import FileEntry
from workers.checkpoint.manifest import (
    MANIFEST,
    CheckpointCorrupt,
    latest_valid,
    prune,
    verify_checkpoint,
    write_manifest,
)
from workers.checkpoint.storage import CheckpointStorage, checkpoint_name, step_of, sub_root


@pytest.fixture(params=["local", "file-uri", "mock"])
def storage(request, tmp_path: Path) -> CheckpointStorage:
    root = {
        "local": str(tmp_path / "ckpt"),
        "file-uri": (tmp_path / "ckpt").as_uri(),
        # Each from_uri("mock://...") is a fresh in-memory filesystem, owned by this storage.
        "mock": "mock:///ckpt",
    }[request.param]
    return CheckpointStorage(root)


def save_checkpoint(storage: CheckpointStorage, step: int, files: dict[str, bytes], meta: dict | None = None) -> str:
    """Write ``files`` then the manifest, as the trainer does; returns the checkpoint name."""
    name = checkpoint_name(step)
    entries = []
    for path, data in files.items():
        sha = storage.write_bytes(f"{name}/{path}", data)
        entries.append(FileEntry(path, sha, len(data)))
    write_manifest(storage, step, entries, meta or {"step": step})
    return name


def all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# --- names -------------------------------------------------------------------------------------


def test_checkpoint_names():
    assert checkpoint_name(40) == "step-00000040"
    assert step_of("step-00000040") == 40
    assert step_of(checkpoint_name(123_456_789)) == 123_456_789
    for other in ("step-40", "step-0000004x", "tmp", "step-00000040.old"):
        assert step_of(other) is None
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="step"):
            checkpoint_name(bad)


# --- files -------------------------------------------------------------------------------------


def test_write_read_round_trip(storage: CheckpointStorage):
    data = os.urandom(3000)
    sha = storage.write_bytes("step-00000001/model.bin", data)
    assert sha == hashlib.sha256(data).hexdigest()
    assert storage.read_bytes("step-00000001/model.bin") == data
    assert storage.sha256_of("step-00000001/model.bin") == (sha, 3000)
    assert storage.size("step-00000001/model.bin") == 3000
    assert storage.exists("step-00000001/model.bin") and storage.exists("step-00000001")
    assert not storage.exists("step-00000001/nope") and storage.size("step-00000001/nope") is None
    storage.write_bytes("step-00000001/model.bin", b"new")  # overwrite
    assert storage.read_bytes("step-00000001/model.bin") == b"new"
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("step-00000001/nope")


def test_write_file_from_hashes_what_was_written(storage: CheckpointStorage):
    def write(handle):
        handle.write(b"abc")
        handle.write(bytearray(b"def"))
        handle.write(memoryview(b"0123456789")[2:5])

    sha, size = storage.write_file_from("a/b/c.bin", write)
    expected = b"abcdef234"
    assert (sha, size) == (hashlib.sha256(expected).hexdigest(), len(expected))
    assert storage.read_bytes("a/b/c.bin") == expected


def test_failed_write_keeps_old_content(storage: CheckpointStorage):
    storage.write_bytes("step-00000001/model.bin", b"old")

    def explode(handle):
        handle.write(b"partial")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        storage.write_file_from("step-00000001/model.bin", explode)
    with pytest.raises(RuntimeError, match="boom"):
        storage.write_file_from("step-00000001/fresh.bin", explode)
    assert storage.read_bytes("step-00000001/model.bin") == b"old"
    assert not storage.exists("step-00000001/fresh.bin")


def test_no_temp_files_left_locally(tmp_path: Path):
    storage = CheckpointStorage(str(tmp_path))
    storage.write_bytes("step-00000001/model.bin", b"old")
    assert all_files(tmp_path) == ["step-00000001/model.bin"]

    def explode(handle):
        handle.write(b"partial")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        storage.write_file_from("step-00000001/model.bin", explode)
    assert all_files(tmp_path) == ["step-00000001/model.bin"]
    assert (tmp_path / "step-00000001/model.bin").read_bytes() == b"old"


def test_list_and_delete(storage: CheckpointStorage):
    assert storage.list_dirs() == []  # root not created yet
    storage.write_bytes("step-00000002/x", b"1")
    storage.write_bytes("step-00000001/sub/y", b"2")
    storage.write_bytes("loose-file", b"3")
    assert storage.list_dirs() == ["step-00000001", "step-00000002"]
    storage.delete_tree("step-00000001")
    storage.delete_tree("step-00000001")  # missing is fine
    assert storage.list_dirs() == ["step-00000002"]
    assert not storage.exists("step-00000001/sub/y")
    storage.delete_file("loose-file")
    storage.delete_file("loose-file")  # missing is fine
    assert not storage.exists("loose-file") and storage.exists("step-00000002/x")


@pytest.mark.parametrize("bad", ["/abs", "../up", "a/../b", "a//b", ""])
def test_paths_must_stay_under_root(storage: CheckpointStorage, bad: str):
    with pytest.raises(ValueError, match="relative"):
        storage.write_bytes(bad, b"x")


def test_locations(tmp_path: Path):
    assert CheckpointStorage(str(tmp_path)).location("s/f") == str(tmp_path / "s" / "f")
    assert CheckpointStorage(tmp_path.as_uri()).location("s/f") == str(tmp_path / "s" / "f")
    assert CheckpointStorage("mock:///bucket/job/").location("s/f") == "mock:///bucket/job/s/f"
    assert CheckpointStorage(str(tmp_path)).where == str(tmp_path)
    assert CheckpointStorage("mock://KEY:SECRET@bucket/job").where == "mock://***@bucket/job"
    with pytest.raises(ValueError, match="host"):
        CheckpointStorage("file://elsewhere/tmp")


def test_sub_root_names_a_directory_under_a_path_or_uri(tmp_path: Path):
    """A run's namespace under a shared root: in a URI before its query string (pyarrow's options)."""
    assert sub_root(str(tmp_path), "r1") == str(tmp_path / "r1")
    assert sub_root(tmp_path.as_uri(), "r1") == (tmp_path / "r1").as_uri()
    assert sub_root("s3://KEY:SECRET@bucket/ckpt/?region=eu-west-1", "r1") == "s3://KEY:SECRET@bucket/ckpt/r1?region=eu-west-1"
    assert sub_root("mock://bucket", "r1") == "mock://bucket/r1"
    outer, inner = CheckpointStorage("mock:///ckpt"), CheckpointStorage(sub_root("mock:///ckpt", "r1"))
    assert inner.location("step-00000001") == outer.location("r1/step-00000001")
    for bad in ("", "..", "a/b", "/abs"):
        with pytest.raises(ValueError):
            sub_root(str(tmp_path), bad)


# --- manifests and verification ----------------------------------------------------------------


def test_manifest_round_trip(storage: CheckpointStorage):
    name = save_checkpoint(storage, 40, {"model.pt": b"weights", "opt/state.pt": b"moments"}, {"world": 4})
    manifest = verify_checkpoint(storage, name)
    assert manifest["format"] == 1 and manifest["step"] == 40 and manifest["meta"] == {"world": 4}
    assert {f["path"]: f["bytes"] for f in manifest["files"]} == {"model.pt": 7, "opt/state.pt": 7}


def test_write_manifest_rejects_bad_input(storage: CheckpointStorage):
    entry = FileEntry("model.pt", "0" * 64, 1)
    with pytest.raises(ValueError, match="meta"):
        write_manifest(storage, 1, [entry], {"bad": object()})
    with pytest.raises(ValueError, match="twice"):
        write_manifest(storage, 1, [entry, entry], {})
    with pytest.raises(ValueError, match="sha256"):
        write_manifest(storage, 1, [FileEntry("model.pt", "xyz", 1)], {})
    with pytest.raises(ValueError, match="relative"):
        write_manifest(storage, 1, [FileEntry("../model.pt", "0" * 64, 1)], {})
    assert not storage.exists(f"step-00000001/{MANIFEST}")


@pytest.mark.parametrize(
    ("damage", "bad_file", "problem"),
    [
        (lambda s, n: s.write_bytes(f"{n}/model.pt", b"weigh"), "model.pt", "size 5 bytes, manifest says 7"),
        (lambda s, n: s.write_bytes(f"{n}/model.pt", b"weightZ"), "model.pt", "sha256 mismatch"),
        (lambda s, n: s.delete_tree(f"{n}/opt"), "opt/state.pt", "missing"),
        (lambda s, n: s.write_bytes(f"{n}/{MANIFEST}", b'{"format": 1, "files": ['), MANIFEST, "invalid"),
        (lambda s, n: s.write_bytes(f"{n}/{MANIFEST}", b'{"format": 9, "files": []}'), MANIFEST, "format"),
        (lambda s, n: s.write_bytes(f"{n}/{MANIFEST}", b'{"format": 1, "step": 41, "files": []}'), MANIFEST, "step"),
    ],
    ids=["truncated", "altered-byte", "missing-file", "broken-json", "wrong-format", "wrong-step"],
)
def test_verify_names_the_bad_file(storage: CheckpointStorage, damage, bad_file: str, problem: str):
    name = save_checkpoint(storage, 40, {"model.pt": b"weights", "opt/state.pt": b"moments"})
    damage(storage, name)
    with pytest.raises(CheckpointCorrupt) as caught:
        verify_checkpoint(storage, name)
    err = caught.value
    assert err.name == name
    assert err.location == storage.location(f"{name}/{bad_file}")
    assert problem in err.problem
    assert err.location in str(err) and name in str(err)


def test_verify_without_manifest(storage: CheckpointStorage):
    storage.write_bytes("step-00000007/model.pt", b"w")
    with pytest.raises(CheckpointCorrupt, match="no manifest"):
        verify_checkpoint(storage, "step-00000007")


def test_corrupt_error_pickles():
    err = pickle.loads(pickle.dumps(CheckpointCorrupt("step-00000001", "/x/model.pt", "missing")))
    assert (err.name, err.location, err.problem) == ("step-00000001", "/x/model.pt", "missing")
    assert str(err) == "checkpoint step-00000001: /x/model.pt: missing"


# --- fallback and pruning ----------------------------------------------------------------------


def test_latest_valid_falls_back(storage: CheckpointStorage):
    assert latest_valid(storage, pytest.fail) is None  # nothing yet, nothing to warn about
    save_checkpoint(storage, 10, {"model.pt": b"ten"})
    save_checkpoint(storage, 20, {"model.pt": b"twenty"})
    bad = save_checkpoint(storage, 30, {"model.pt": b"thirty"})
    storage.write_bytes(f"{bad}/model.pt", b"thirtY")
    storage.write_bytes("step-00000040/model.pt", b"forty")  # its manifest never arrived
    warnings: list[str] = []

    found = latest_valid(storage, warnings.append)

    assert found is not None and found[0] == "step-00000020" and found[1]["step"] == 20
    assert len(warnings) == 2
    assert "step-00000040" in warnings[0] and "incomplete (no manifest)" in warnings[0]
    assert storage.location(f"{bad}/model.pt") in warnings[1] and "sha256 mismatch" in warnings[1]
    assert "previous checkpoint step-00000020" in warnings[1]


def test_latest_valid_none_when_all_bad(storage: CheckpointStorage):
    bad = save_checkpoint(storage, 10, {"model.pt": b"ten"})
    storage.write_bytes(f"{bad}/{MANIFEST}", b"not json")
    warnings: list[str] = []
    assert latest_valid(storage, warnings.append) is None
    assert len(warnings) == 1 and MANIFEST in warnings[0] and "no earlier checkpoint" in warnings[0]


def test_prune(storage: CheckpointStorage):
    for step in (10, 20, 30):
        save_checkpoint(storage, step, {"model.pt": b"w"})
    for step in (5, 25, 40):  # no manifests: 5 and 25 abandoned, 40 possibly being written now
        storage.write_bytes(f"{checkpoint_name(step)}/model.pt", b"partial")
    storage.write_bytes("not-a-checkpoint/file", b"x")

    assert prune(storage, keep=2) == ["step-00000005", "step-00000010", "step-00000025"]
    assert storage.list_dirs() == ["not-a-checkpoint", "step-00000020", "step-00000030", "step-00000040"]
    assert prune(storage, keep=2) == []
    assert prune(storage, keep=1) == ["step-00000020"]
    with pytest.raises(ValueError, match="keep"):
        prune(storage, keep=0)


def test_prune_without_complete_checkpoints_deletes_nothing(storage: CheckpointStorage):
    storage.write_bytes("step-00000005/model.pt", b"partial")
    assert prune(storage, keep=1) == []
    assert storage.list_dirs() == ["step-00000005"]


def test_prune_never_deletes_the_last_good_checkpoint_for_a_broken_newer_one(storage: CheckpointStorage):
    save_checkpoint(storage, 10, {"model.pt": b"good"})
    broken = save_checkpoint(storage, 20, {"model.pt": b"newer"})
    storage.write_bytes(f"{broken}/model.pt", b"NEWER")  # same size, other bytes: sha256 fails
    assert prune(storage, keep=1) == []
    assert storage.list_dirs() == ["step-00000010", "step-00000020"]
    assert prune(storage, keep=1, newest_good="step-00000020") == ["step-00000010"]
