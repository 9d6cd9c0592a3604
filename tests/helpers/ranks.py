"""Helpers for multi-process tests: real gloo process groups in spawned processes, no Ray."""

from __future__ import annotations

import socket
import threading
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from workers.comm.comm_group import CommGroup
from workers.comm.process_group import new_process_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp_store(rank: int, world: int, port: int) -> dist.TCPStore:
    """The test's rendezvous store on ``port``, hosted by rank 0; one per process, reused by
    every generation of groups (as the driver's is)."""
    return dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, wait_for_workers=False)


def comm_group(
    rank: int, world: int, port_or_store: int | dist.Store, prefix: str = "g1/", timeout_s: float = 30.0
) -> CommGroup:
    """Rank ``rank``'s CommGroup under ``prefix`` of a store (or a new store on a port)."""
    store = tcp_store(rank, world, port_or_store) if isinstance(port_or_store, int) else port_or_store
    pg = new_process_group("gloo", dist.PrefixStore(prefix, store), rank, world, timeout_s)
    return CommGroup(pg, rank, world, timeout_s, threading.Event())


def run_ranks(target: Callable[..., None], world: int, *args: Any) -> dict:
    """Run ``target(rank, world, port, results, *args)`` in ``world`` processes; returns what
    they put in ``results`` (a shared dict)."""
    # The manager's server process is spawned, not forked: this process may hold a running
    # Ray (the session's cluster), and a forked copy of Ray's threads can abort in the child.
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.spawn(target, args=(world, free_port(), results, *args), nprocs=world, join=True)
        return dict(results)
