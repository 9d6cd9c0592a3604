"""Ranks in spawned processes, no Ray: ``spawn_ranks`` runs one function on ``world`` fresh
interpreters that share a rendezvous ``TCPStore`` (rank 0 hosts it), and returns what each
returned. The benchmarks use it to measure real workers (``workers.actor.TrainWorker``) in a
real group over gloo, outside Ray, so what a rank holds is read from its own tensors.

Spawned, not forked: the calling process may hold a running Ray, whose threads a forked child
would inherit in an unknown state. A rank's output (its own and the C++ libraries': the
profiler's notices) goes to a log file, not the caller's terminal; a failure's error carries its
end.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queues
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

#: How long rank 0 waits for the others to finish with its store before it closes it.
_FINISH_TIMEOUT_S = 60.0
#: How often the parent looks for ranks that died without a word.
_POLL_S = 0.5


class RankError(RuntimeError):
    """A rank failed or ran out of time; the message carries its traceback."""


def _rank_main(
    target: Callable[..., Any], rank: int, world: int, port: Any, ready: Any, results: Any, log: str, args: tuple[Any, ...]
) -> None:
    """One rank, its output (file descriptors 1 and 2) into ``log``: rank 0 hosts the store on a
    free port and publishes it (``port``, ``ready``); every rank runs ``target(rank, world,
    port, *args)`` and puts ``(rank, ok, value)`` on ``results``; rank 0 keeps the store up
    until every rank has finished with it."""
    with open(log, "ab", buffering=0) as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    try:
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
            port.value = store.port
            ready.set()
        else:
            ready.wait()
            store = dist.TCPStore("127.0.0.1", port.value, world, is_master=False, wait_for_workers=False)
        value = target(rank, world, port.value, *args)
        store.add("finished", 1)
        if rank == 0:
            deadline = time.monotonic() + _FINISH_TIMEOUT_S
            while store.add("finished", 0) < world and time.monotonic() < deadline:
                time.sleep(0.05)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        ready.set()  # a rank 0 that failed before its store was up must not leave the others waiting
        results.put((rank, False, traceback.format_exc()))


def _check_alive(processes: list[Any], reported: dict[int, Any], deadline: float, timeout_s: float) -> None:
    """RankError if a rank that has not reported exited (it died before it could: a crash, a
    signal, a main module that spawns again on import) or the deadline passed."""
    silent = [rank for rank, process in enumerate(processes) if rank not in reported]
    dead = [rank for rank in silent if processes[rank].exitcode is not None]
    if dead:
        codes = ", ".join(f"rank {rank} exit code {processes[rank].exitcode}" for rank in dead)
        raise RankError(f"{codes} without a result")
    if time.monotonic() > deadline:
        raise RankError(f"ranks {silent} ran past {timeout_s:.0f}s")


def spawn_ranks(target: Callable[..., Any], world: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """``target(rank, world, port, *args)`` in ``world`` spawned processes, ``port`` that of the
    group's ``TCPStore`` on 127.0.0.1 (hosted by rank 0 until every rank returned); returns
    each rank's return value, by rank. ``target``, ``args`` and the values must pickle
    (``target`` a module-level function). Raises RankError with the first failing rank's
    traceback, or when the ranks run past ``timeout_s`` (every rank is then killed)."""
    with tempfile.TemporaryDirectory(prefix="rl-ranks-") as logs:
        try:
            return _run(target, world, args, timeout_s, Path(logs))
        except RankError as err:
            tails = "".join(_tail(Path(logs) / f"rank-{rank}.log", rank) for rank in range(world))
            raise RankError(f"{err}\n{tails}") from None


def _tail(log: Path, rank: int, lines: int = 15) -> str:
    """The last ``lines`` of rank ``rank``'s output, headed, or nothing where it wrote none."""
    text = log.read_text(errors="replace").strip() if log.exists() else ""
    return f"--- rank {rank} output (end) ---\n" + "\n".join(text.splitlines()[-lines:]) + "\n" if text else ""


def _run(target: Callable[..., Any], world: int, args: tuple[Any, ...], timeout_s: float, logs: Path) -> list[Any]:
    """``spawn_ranks``'s work, each rank's output in ``logs``."""
    context = multiprocessing.get_context("spawn")
    port, ready, results = context.Value("i", 0), context.Event(), context.Queue()
    processes = [
        context.Process(
            target=_rank_main, args=(target, rank, world, port, ready, results, str(logs / f"rank-{rank}.log"), args),
            daemon=True,
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world:
            try:
                rank, ok, value = results.get(timeout=_POLL_S)
            except queues.Empty:
                _check_alive(processes, values, deadline, timeout_s)
                continue
            if not ok:
                raise RankError(f"rank {rank} failed:\n{value}")
            values[rank] = value
        for process in processes:
            process.join(timeout=_FINISH_TIMEOUT_S)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [values[rank] for rank in range(world)]
