"""The replica's checkpoints: which of its tensors a checkpoint holds, its part copied between two
steps and written in the background, and a checkpoint's state restored into it.

The part files themselves (slicing, format, reading back and verifying) are
``workers/checkpoint/parts.py``; the driver coordinates the parts and writes the manifest
(``orchestrator/checkpoints/coordinator.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from jobspec.wire import PartWritten, SnapshotRequest
from policies.sharding import Span
from workers.checkpoint.parts import FlatPieces, PartSnapshot, take_snapshot, write_snapshot
from workers.checkpoint.reading import open_checkpoint
from workers.checkpoint.storage import CheckpointStorage
from workers.optim.named_tensors import check_fit, copy_by_name
from workers.replica import Replica
from workers.runtime.chaos import ChaosSchedule, kill_self


def checkpointed_tensors(
    replica: Replica, whole: bool = True
) -> tuple[dict[str, torch.Tensor | FlatPieces], dict[str, torch.Tensor]]:
    """The training state a checkpoint holds, by name, uncopied: the flat tensors
    (parameters and optimizer state, all one length, written in slices; a generic
    optimizer's per-parameter state as ``FlatPieces``) and the whole ones (only part 0
    writes them: ``whole=False`` leaves them out, sparing a generic optimizer's skeleton)."""
    optim_flat, optim_whole = replica.optimizer.checkpoint_tensors(whole)
    flat = {"params": replica.flat.values, **{f"optim/{k}": v for k, v in optim_flat.items()}}
    if not whole:
        return flat, {}
    return flat, {**{f"optim/{k}": v for k, v in optim_whole.items()}, **_model_tensors(replica)}


def _model_tensors(replica: Replica) -> dict[str, torch.Tensor]:
    """The whole tensors a checkpoint holds besides the optimizer's: buffers and the loss scale."""
    found = {f"buffer/{k}": v for k, v in replica.model.named_buffers()}
    if replica.scaler.enabled:
        found["loss_scale"] = replica.scaler.state
    return found


def restore_state(
    replica: Replica, storage: CheckpointStorage, name: str, manifest: dict[str, Any], span: Span | None = None
) -> None:
    """Take checkpoint ``name``'s training state (already verified against ``manifest``) into
    ``replica``: buffers, loss scale, RNG and step, and the parameters and optimizer state, all
    of them, or with a sharded optimizer entries ``span`` (None: all) of them: only the parts,
    and the byte ranges of parts, that hold the span are read, straight into the replica's
    memory (the join's all-gather brings the other parameters). Raises ValueError if the
    checkpoint is for another model or optimizer (nothing changed then), CheckpointCorrupt if
    a file's size or header changed since it was verified or it no longer reads (the replica
    then holds no state: ``next_step`` -1)."""
    saved = open_checkpoint(storage, name, manifest)  # its headers only
    whole = saved.read_whole()
    # What it restores into besides the optimizer (a sharded one may hold nothing yet), checked
    # before anything is read into it: the flat tensors' lengths from the headers.
    model = _model_tensors(replica)
    loaded = {
        **{k: torch.empty(v.shape, device="meta") for k, v in saved.flat.items() if not k.startswith("optim/")},
        **{k: v for k, v in whole.items() if not k.startswith(("optim/", "rng/"))},
    }
    check_fit({"params": replica.flat.values, **model}, loaded, lambda held, needed: f"checkpoint {name} holds {held}, this model needs {needed}")
    optimizer_whole = {k[len("optim/"):]: v for k, v in whole.items() if k.startswith("optim/")}
    optimizer_flat = {k[len("optim/"):]: v for k, v in saved.flat.items() if k.startswith("optim/")}
    # Checked and read before it takes any of it: it raises with nothing changed.
    lo, hi = replica.state.restore(optimizer_flat, optimizer_whole, span, saved.numel)
    replica.next_step = -1  # its state is the checkpoint's only once the parameters are read too
    saved.flat["params"].read(lo, hi, replica.flat.values[lo:hi])
    copy_by_name(model, {k: whole[k] for k in model})
    replica.scaler.state_restored()
    torch.set_rng_state(whole["rng/torch"])
    replica.next_step = int(manifest["step"])
    replica.state.restored_at(replica.next_step)


def chain_future(done: Future[Any], into: Future[Any]) -> None:
    """Settle ``into`` with ``done``'s result or error."""
    error = done.exception()
    if error is not None:
        into.set_exception(error)
    else:
        into.set_result(done.result())


def _abandon(attempt: str, outcome: Future[PartWritten]) -> None:
    """Settle ``outcome``, the write of cancelled checkpoint ``attempt``, as abandoned."""
    if not outcome.done():
        outcome.set_exception(RuntimeError(f"checkpoint attempt {attempt} was abandoned by the driver before its snapshot"))


class CheckpointWriter:
    """Writes the replica's parts of checkpoints on a thread of its own while training goes on.

    ``snapshot`` (between two steps) copies a part and queues its write; ``written`` waits for
    it (the two run in different concurrency groups, so either may come first). ``chaos`` may
    kill the worker mid-write, calling ``on_death`` first.

    An attempt the driver abandons (``cancel``: its batch failed before the step, a worker left,
    it ran out of time) ends at once if its snapshot has not come: a wait for it, running or
    still queued, raises, and its snapshot is not taken. Otherwise such a wait would hold the
    actor's one ``io`` thread for ``timeouts.checkpoint_s``, every later attempt's wait queued
    behind it.
    """

    def __init__(self, chaos: ChaosSchedule, on_death: Callable[[], None]) -> None:
        self.chaos = chaos
        self.on_death = on_death
        # At the process's own priority, not niced: the write takes the GIL between its native
        # calls, and a niced thread preempted while holding it stalls the training thread until
        # the scheduler runs it again. Digits, 2 workers on 2 cores, a checkpoint every 20
        # steps: the step after a snapshot took 7-10 ms longer with the writer niced to 19,
        # 5-6 ms at the same priority (docs/benchmarks.md, "Checkpoint overhead").
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ringleader-checkpoint")
        self._writes: dict[str, Future[PartWritten]] = {}
        self._taken: set[str] = set()  # attempts whose snapshot came
        self._cancelled: set[str] = set()  # attempts the driver abandoned (a few strings a failure)
        self._writes_lock = threading.Lock()

    def snapshot(
        self, request: SnapshotRequest, replica: Replica, residuals: dict[tuple[int, int], torch.Tensor], rank: int
    ) -> float:
        """Copy part ``request.index`` of ``request.count`` of ``replica``'s state after
        ``request.step`` steps (with rank ``rank``'s top-k ``residuals``) to memory and start
        writing it. Raises RuntimeError if the replica is not there (an aborted step) or the
        attempt was cancelled. Returns the seconds the copy took."""
        step, name = request.step, request.name
        attempt = f"{name}/{request.tag}"
        written = self._start(attempt)
        try:
            if written.done():  # cancelled before its snapshot came
                written.result()
            if replica.next_step != step:
                raise RuntimeError(
                    f"checkpoint {name} wants the state after step {step}, this replica is at {replica.next_step}"
                )
            started = time.perf_counter()
            flat, whole = checkpointed_tensors(replica, whole=request.index == 0)
            whole["rng/torch"] = torch.get_rng_state()
            part = take_snapshot(step, request.index, request.count, flat, whole, residuals)
            part.copy_s = time.perf_counter() - started
        except BaseException as err:
            if not written.done():
                written.set_exception(err)
            raise
        writing = self._writer.submit(self._write, CheckpointStorage(request.root), name, request.tag, part, rank)
        writing.add_done_callback(lambda done: chain_future(done, written))
        return part.copy_s

    def written(self, name: str, tag: str, timeout_s: float) -> PartWritten:
        """Wait (up to ``timeout_s``) for attempt ``tag`` of checkpoint ``name`` to be written;
        returns what was written (the files, the write's CPU) or raises the write's error,
        TimeoutError, or RuntimeError if the attempt was cancelled before its snapshot."""
        attempt = f"{name}/{tag}"
        try:
            return self._future(attempt).result(timeout=timeout_s)
        finally:
            with self._writes_lock:
                self._writes.pop(attempt, None)
                self._taken.discard(attempt)

    def cancel(self, name: str, tag: str) -> None:
        """The driver abandoned attempt ``tag`` of checkpoint ``name``: if its snapshot has not
        come, a wait for it (now or later) raises at once and the snapshot is not taken; a part
        already being written is left to finish (the driver prunes what has no manifest)."""
        attempt = f"{name}/{tag}"
        with self._writes_lock:
            self._cancelled.add(attempt)
            outcome = self._writes.get(attempt)
            if outcome is not None and attempt not in self._taken:
                _abandon(attempt, outcome)

    def _future(self, attempt: str) -> Future[PartWritten]:
        """The outcome of one checkpoint attempt's write (``name/tag``), shared by ``snapshot``
        and ``written``, whichever asks first; settled already if the attempt was cancelled
        before its snapshot."""
        with self._writes_lock:
            outcome = self._writes.setdefault(attempt, Future())
            if attempt in self._cancelled and attempt not in self._taken:
                _abandon(attempt, outcome)
            return outcome

    def _start(self, attempt: str) -> Future[PartWritten]:
        """``_future`` for ``attempt``'s snapshot, marking it taken unless it was cancelled."""
        outcome = self._future(attempt)
        with self._writes_lock:
            if attempt not in self._cancelled:
                self._taken.add(attempt)
        return outcome

    def _write(self, storage: CheckpointStorage, name: str, tag: str, part: PartSnapshot, rank: int) -> PartWritten:
        if self.chaos.kill_due("checkpoint", part.step - 1):
            kill_self(self.on_death)  # mid-write: some parts may be on disk, no manifest
        started = time.thread_time()
        files = write_snapshot(storage, name, tag, rank, part)
        return PartWritten(tuple(files), time.thread_time() - started)
