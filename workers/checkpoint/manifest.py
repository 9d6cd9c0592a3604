"""Checkpoint manifests: ``<root>/step-00000040/manifest.json`` lists every file of a
checkpoint with its size and sha256. The manifest is written last, so a directory without one
is a write that has not finished (or never will): a checkpoint exists only once its manifest
does, and it is good only if every file matches the manifest (docs/architecture.md,
"Checkpoints").

No torch or Ray here.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from typing import Any, Callable

from jobspec.wire import FileEntry
from workers.checkpoint.storage import CheckpointStorage, checkpoint_name, split_relpath, step_of

MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointCorrupt(Exception):
    """A checkpoint failed verification.

    ``name`` is the checkpoint, ``location`` the full path or URI of the bad file (its manifest
    if that is what is wrong), ``problem`` what is wrong: missing, wrong size, sha256 mismatch,
    unreadable or invalid manifest.
    """

    def __init__(self, name: str, location: str, problem: str) -> None:
        # All three go to Exception so the error pickles (Ray ships exceptions between processes).
        super().__init__(name, location, problem)
        self.name, self.location, self.problem = name, location, problem

    def __str__(self) -> str:
        return f"checkpoint {self.name}: {self.location}: {self.problem}"


def write_manifest(storage: CheckpointStorage, step: int, files: list[FileEntry], meta: dict[str, Any]) -> str:
    """Write ``<checkpoint_name(step)>/manifest.json`` atomically; returns its relpath.

    Call it after every file in ``files`` has been written: the manifest is what makes the
    checkpoint exist. Content: ``{"format": 1, "step": step, "files": [...], "meta": meta}``;
    ``meta`` must be JSON-able.
    """
    name = checkpoint_name(step)
    seen: set[str] = set()
    for entry in files:
        split_relpath(entry.path)  # rejects absolute paths and ".." before anything is written
        if entry.path == MANIFEST or entry.path in seen:
            raise ValueError(f"files: {entry.path!r} is listed twice or is the manifest itself")
        if not re.fullmatch(r"[0-9a-f]{64}", entry.sha256):
            raise ValueError(f"files: {entry.path!r} sha256 must be 64 lowercase hex digits, got {entry.sha256!r}")
        if isinstance(entry.bytes, bool) or not isinstance(entry.bytes, int) or entry.bytes < 0:
            raise ValueError(f"files: {entry.path!r} bytes must be an int >= 0, got {entry.bytes!r}")
        seen.add(entry.path)
    manifest = {"format": FORMAT, "step": step, "files": [asdict(f) for f in files], "meta": meta}
    try:
        text = json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be JSON-able: {e}") from e
    relpath = f"{name}/{MANIFEST}"
    storage.write_bytes(relpath, text.encode())
    return relpath


def verify_checkpoint(storage: CheckpointStorage, name: str) -> dict[str, Any]:
    """Check checkpoint ``name`` against its manifest; returns the manifest.

    Raises CheckpointCorrupt naming the file (full path or URI) and what is wrong: the manifest
    missing, unreadable or invalid, or a listed file missing, of the wrong size or sha256.
    """
    manifest_path = f"{name}/{MANIFEST}"
    where = storage.location(manifest_path)
    try:
        manifest = json.loads(storage.read_bytes(manifest_path))
    except FileNotFoundError:
        raise CheckpointCorrupt(name, where, "missing (incomplete write: no manifest)") from None
    except (OSError, ValueError) as e:  # ValueError covers JSON and UTF-8 decoding errors
        raise CheckpointCorrupt(name, where, f"unreadable or invalid manifest: {e}") from e
    problem = _manifest_problem(manifest, step_of(name))
    if problem:
        raise CheckpointCorrupt(name, where, f"invalid manifest: {problem}")
    # Sizes first, all of them: a cheap stat finds truncated or missing files before any hashing.
    for entry in manifest["files"]:
        relpath = f"{name}/{entry['path']}"
        size = storage.size(relpath)
        if size is None:
            raise CheckpointCorrupt(name, storage.location(relpath), "missing")
        if size != entry["bytes"]:
            raise CheckpointCorrupt(
                name, storage.location(relpath), f"size {size} bytes, manifest says {entry['bytes']}"
            )
    for entry in manifest["files"]:
        relpath = f"{name}/{entry['path']}"
        sha, _ = storage.sha256_of(relpath)
        if sha != entry["sha256"]:
            raise CheckpointCorrupt(
                name, storage.location(relpath), f"sha256 mismatch: {sha}, manifest says {entry['sha256']}"
            )
    return manifest


def latest_valid(storage: CheckpointStorage, warn: Callable[[str], None]) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint that verifies, as ``(name, manifest)``; None if there is none.

    Checkpoints are tried newest step first. Each one passed over is reported through
    ``warn(message)``: the message names the bad file and what is wrong (or says the checkpoint
    is incomplete, with no manifest) and which checkpoint is tried next.
    """
    names = [n for _, n in _checkpoint_dirs(storage)]
    for i, name in enumerate(names):
        following = (
            f"falling back to the previous checkpoint {names[i + 1]}"
            if i + 1 < len(names)
            else "no earlier checkpoint to fall back to"
        )
        if not storage.exists(f"{name}/{MANIFEST}"):
            warn(f"checkpoint {name} is incomplete (no manifest) at {storage.location(name)}; {following}")
            continue
        try:
            return name, verify_checkpoint(storage, name)
        except CheckpointCorrupt as e:
            warn(f"checkpoint {name} is corrupt: {e.location}: {e.problem}; {following}")
    return None


def prune(storage: CheckpointStorage, keep: int, newest_good: str | None = None) -> list[str]:
    """Delete old checkpoints; returns the deleted names, oldest first.

    Only checkpoints older than ``newest_good`` are candidates: the newest checkpoint known to
    verify (None: found by verifying from the newest down; nothing is deleted if none does).
    Of them, the newest ``keep - 1`` with a manifest stay (``newest_good`` makes ``keep``), the
    older ones go, with any manifest-less directory older than ``newest_good`` (an abandoned
    write). Anything newer than ``newest_good`` (a broken checkpoint, a write in progress) is
    never touched, so a corrupt newest checkpoint cannot cost the last good one.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    dirs = _checkpoint_dirs(storage)
    complete = [(step, n) for step, n in dirs if storage.exists(f"{n}/{MANIFEST}")]
    if newest_good is None:
        newest_good = next((n for _, n in complete if _verifies(storage, n)), None)
        if newest_good is None:
            return []
    good_step = step_of(newest_good)
    if good_step is None:
        raise ValueError(f"newest_good must be a checkpoint name, got {newest_good!r}")
    older = [(step, n) for step, n in complete if step < good_step]
    doomed = older[keep - 1 :] + [(step, n) for step, n in dirs if step < good_step and (step, n) not in complete]
    deleted = [n for _, n in sorted(doomed)]
    for name in deleted:
        storage.delete_tree(name)
    return deleted


def _verifies(storage: CheckpointStorage, name: str) -> bool:
    try:
        verify_checkpoint(storage, name)
    except CheckpointCorrupt:
        return False
    return True


def _checkpoint_dirs(storage: CheckpointStorage) -> list[tuple[int, str]]:
    """``(step, name)`` of the checkpoint directories under the root, newest step first."""
    named = [(step_of(n), n) for n in storage.list_dirs()]
    return sorted(((step, n) for step, n in named if step is not None), reverse=True)


def _manifest_problem(manifest: Any, expected_step: int | None) -> str | None:
    if not isinstance(manifest, dict):
        return f"expected a JSON object, got {type(manifest).__name__}"
    if manifest.get("format") != FORMAT:
        return f"format is {manifest.get('format')!r}, expected {FORMAT}"
    if expected_step is not None and manifest.get("step") != expected_step:
        return f"step is {manifest.get('step')!r}, but the directory is for step {expected_step}"
    files = manifest.get("files")
    if not isinstance(files, list):
        return "files is not a list"
    for i, entry in enumerate(files):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("path"), str)
            and isinstance(entry.get("sha256"), str)
            and isinstance(entry.get("bytes"), int)
        ):
            return f"files[{i}] needs path (str), sha256 (str) and bytes (int), got {entry!r}"
        try:
            split_relpath(entry["path"])
        except ValueError as e:
            return f"files[{i}]: {e}"
    return None
