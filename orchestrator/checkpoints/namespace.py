"""A run's own checkpoint namespace, the run directory it belongs to, and holding it.

Jobs may share a ``checkpoint.path`` (every Tune trial of a base job that sets one does): each
run writes under ``<checkpoint root>/<run id>/`` (the id recorded in its run directory,
``orchestrator/output/run_dir.py``), and prunes, looks for its saved steps and resumes only there, so
no run ever reads, counts or deletes another's checkpoints. The namespace records the run
directory it belongs to (``owner.json``): a copy of that directory (same run id, the original
still there) is refused rather than let two runs write one namespace, unless the namespace
lies inside the copy (the default root, copied along with it, is the copy's own). A run
directory seen at another path (moved, or mounted elsewhere: another host, a restarted pod)
is the same run, and the namespace records its new path. One live driver at a time writes a
namespace: ``hold_namespace`` holds its lease (``orchestrator/checkpoints/lease.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Callable, Iterator

from jobspec.fields import ConfigError
from jobspec.job import JobConfig
from orchestrator.checkpoints.lease import NamespaceLease
from orchestrator.output.run_dir import RunDirectory, read_run_id
from workers.checkpoint.storage import CheckpointStorage, absolute_root, sub_root

#: Names the run directory a namespace belongs to (written by its first driver, and again by a
#: driver that finds the directory moved).
OWNER_FILE = "owner.json"


def namespace_root(job: JobConfig, run_dir: Path, run_id: str | None) -> str:
    """Where the run ``run_id`` keeps its checkpoints, absolute: ``<root>/<run id>``, the root
    ``checkpoint.path`` or ``<run dir>/checkpoints``. ``run_id`` None: a run directory made
    before run ids, whose checkpoints are flat under the root; it reads and goes on writing
    them there, so it still resumes (other runs' namespaces are directories not named
    ``step-N``, which it neither lists nor prunes)."""
    root = absolute_root(job.checkpoint.path or str(run_dir / "checkpoints"))
    return root if run_id is None else sub_root(root, run_id)


def run_namespace(job: JobConfig, run_dir: Path) -> str:
    """``namespace_root`` of the run directory ``run_dir``, its id read back (``read_run_id``).
    Raises ConfigError if ``run_dir`` is a copy of the run that owns it (``check_owner``)."""
    run_id = read_run_id(run_dir)
    root = namespace_root(job, run_dir, run_id)
    if run_id is not None:
        check_owner(CheckpointStorage(root), run_dir, run_id)
    return root


def check_owner(storage: CheckpointStorage, run_dir: Path, run_id: str) -> bool:
    """Whether the namespace in ``storage`` is to record ``run_dir`` as its owner: it names
    none, an unreadable one, or another path that is not a copy of this run (``_a_copy``: the
    directory moved here, or is mounted here from another path). Raises ConfigError if it is
    owned by another run directory that still holds this run (same run id) and ``run_dir`` is
    a copy of it: their checkpoints would overwrite and prune each other's. A namespace inside
    ``run_dir`` is its own whatever the file says: a copy of a run directory carries its
    default root along. Raises ConfigError naming the file if the storage fails."""
    mine = os.path.realpath(run_dir)
    try:
        owner = str(json.loads(storage.read_bytes(OWNER_FILE))["run_dir"])
    except FileNotFoundError:
        return True
    except (ValueError, TypeError, KeyError):  # written whole, so no owner's: ours from now on
        return True
    except OSError as err:
        raise ConfigError(f"checkpoint.path: cannot read {storage.location(OWNER_FILE)}: {type(err).__name__}: {err}") from None
    if owner == mine:
        return False
    if storage.is_local and os.path.realpath(storage.where).startswith(mine + os.sep):
        return True
    if not _a_copy(run_dir, Path(owner), run_id):
        return True
    raise ConfigError(
        f"run directory {run_dir} is a copy of {owner} (run id {run_id}): both would write the checkpoints in "
        f"{storage.where} and prune each other's; start a new run with a new --run-dir instead (or, to go on in this "
        f"copy rather than in {owner}, delete {storage.location(OWNER_FILE)})"
    )


def _a_copy(run_dir: Path, owner: Path, run_id: str) -> bool:
    """Whether ``run_dir`` is a copy of the run directory ``owner``: that one still exists here,
    is another directory (not ``run_dir`` seen through another path: a bind mount, a link) and
    still holds the run ``run_id``. Else ``run_dir`` is that run, moved (``owner`` gone, or
    holding another run by now) or mounted at another path (``owner`` a path on another host
    or in an earlier container)."""
    try:
        return not os.path.samefile(owner, run_dir) and read_run_id(owner) == run_id
    except (OSError, ConfigError):  # no such directory here (or none we can read): nothing to copy from
        return False


def _record_owner(storage: CheckpointStorage, run_dir: Path) -> None:
    text = json.dumps({"format": 1, "run_dir": os.path.realpath(run_dir)}, sort_keys=True).encode()
    try:
        storage.write_bytes(OWNER_FILE, text)
    except OSError as err:
        raise ConfigError(f"checkpoint.path: cannot write {storage.location(OWNER_FILE)}: {type(err).__name__}: {err}") from None


@contextlib.contextmanager
def hold_namespace(
    job: JobConfig, run: RunDirectory, on_wait: Callable[[str], None] | None = None
) -> Iterator[NamespaceLease | None]:
    """Hold the lease of ``run``'s checkpoint namespace while the block runs (None, and no
    lease, when the job takes no checkpoints), the namespace recorded as ``run``'s. A lease
    whose driver may be gone is first waited out, for at most its ``stale_s``
    (``NamespaceLease.acquire``; ``on_wait`` is told). Raises on entry, having written
    nothing: ConfigError if ``run`` is a copy of the run directory that owns the namespace
    (``check_owner``) or the storage fails, NamespaceBusy if another live driver holds it."""
    if not job.checkpoint.enabled:
        yield None
        return
    lease = NamespaceLease(namespace_root(job, run.path, run.run_id))
    record = run.run_id is not None and check_owner(lease.storage, run.path, run.run_id)
    lease.acquire(on_wait)
    try:
        if record:
            _record_owner(lease.storage, run.path)
        yield lease
    finally:
        lease.release()
