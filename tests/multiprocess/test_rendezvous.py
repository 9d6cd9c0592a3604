"""The driver's rendezvous store: bound to the workers' interface only, keys under a per-job secret;
its failures named by its address."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from orchestrator.errors import StoreFailed
from orchestrator.store.rendezvous import STORE_CALL_SLACK_S, RendezvousStore
from orchestrator.store.server_process import StoreProcessError
from policies.work_stealing import StepPlan
from workers.step.claims import open_step


def test_the_store_listens_on_the_given_address_only():
    store = RendezvousStore("127.0.0.1", 5.0)
    with socket.create_connection(("127.0.0.1", store.port), timeout=2):
        pass
    with pytest.raises(OSError):  # another loopback address: nothing listens there
        socket.create_connection(("127.0.0.2", store.port), timeout=2).close()


def test_a_stray_client_cannot_read_or_forge_a_claim():
    store = RendezvousStore("127.0.0.1", 5.0)
    prefix = store.next_prefix()
    store.claims.of_rank(0).multi_set(["claim/0/0"], [b"free"])
    stray = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=2))
    assert not stray.check([f"{prefix}claim/0/0"])  # the real key is under the job's secret
    stray.set(f"{prefix}claim/0/0", "done:9")  # a forged claim lands outside the namespace
    assert store.claims.of_rank(0).get("claim/0/0") == b"free"
    assert len(store.namespace) == 33 and store.namespace != RendezvousStore("127.0.0.1", 5.0).namespace


def test_the_store_in_its_own_process_serves_claims_and_stops_with_close():
    store = RendezvousStore("127.0.0.1", 5.0, own_process=True)
    try:
        store.next_prefix()
        store.claims.of_rank(0).multi_set(["claim/0/0"], [b"free"])
        assert store.claims.of_rank(0).compare_set("claim/0/0", "free", "run:1") == b"run:1"
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=2))
        worker = dist.PrefixStore("gen1/", dist.PrefixStore(store.namespace, client))  # as join_group builds it
        assert worker.get("claim/0/0") == b"run:1"  # what a worker sees: the same server
        assert store.process is not None and store.server_cpu_s() is not None and store.server_cpu_s() >= 0
        with pytest.raises(OSError):  # it listens on the given address only
            socket.create_connection(("127.0.0.2", store.port), timeout=2).close()
    finally:
        store.close()
    assert store.process._proc.poll() is not None  # stopped and reaped
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", store.port), timeout=2).close()
    assert RendezvousStore("127.0.0.1", 5.0).server_cpu_s() is None  # in-process: in the driver's CPU


def test_a_dead_store_process_is_named_by_its_address_and_its_errors_too():
    store = RendezvousStore("127.0.0.1", 5.0, own_process=True)
    try:
        store.next_prefix()
        store.check_alive()  # alive: no error
        address = f"the job's store (rendezvous and shard claims) at 127.0.0.1:{store.port}"
        os.kill(store.process.pid, signal.SIGKILL)
        store.process._proc.wait(timeout=5)
        with pytest.raises(StoreProcessError, match=re.escape(f"{address} died: its process (pid {store.process.pid}) was killed by signal 9")):
            store.check_alive()
        with pytest.raises(StoreFailed, match=re.escape(address)):  # not torch's RuntimeError
            store.read("key")
        with pytest.raises(StoreFailed, match=re.escape(f"{address} died")):
            with store.named_errors("opening claims"):
                open_step(store.claims, 0, StepPlan(((0,), (1,))))
    finally:
        store.close()


def test_a_store_error_with_the_process_alive_names_the_store_and_the_error():
    store = RendezvousStore("127.0.0.1", 5.0)
    with pytest.raises(StoreFailed, match=r"^the job's store .* at 127\.0\.0\.1:\d+ failed opening claims: RuntimeError: reset$"):
        with store.named_errors("opening claims"):
            raise RuntimeError("reset\nat frame #0 of the C++ trace")


def test_a_store_process_that_ended_itself_is_named_with_its_last_words():
    store = RendezvousStore("no-such-host.invalid", 5.0, own_process=True)
    try:
        store.process._proc.wait(timeout=60)  # it cannot listen there: it fails and exits
        with pytest.raises(StoreProcessError, match=r"^the job's store .* at no-such-host\.invalid:\? died: its process \(pid \d+\) exited with status 1: .*gaierror"):
            store.check_alive()
    finally:
        store.close()


def test_a_store_that_stopped_answering_is_named_within_its_timeout_not_waited_on_forever():
    # Alive but wedged (SIGSTOP): torch's client waits on such a server past its own timeout,
    # so every driver call that needs an answer is bounded by the store's timeout plus a slack.
    store = RendezvousStore("127.0.0.1", 1.0, own_process=True)
    try:
        store.next_prefix()
        store.claims.of_rank(0).multi_set(["claim/0/0"], [b"free"])
        os.kill(store.process.pid, signal.SIGSTOP)
        stopped_by = time.monotonic() + 10
        while Path(f"/proc/{store.process.pid}/stat").read_text().split()[2] != "T":  # the signal is delivered late
            assert time.monotonic() < stopped_by, "the store process did not stop"
            time.sleep(0.01)
        bound_s = 1.0 + STORE_CALL_SLACK_S + 2.0
        started = time.monotonic()
        with pytest.raises(StoreFailed, match=r"^the job's store .* at 127\.0\.0\.1:\d+ did not answer within \d+s reading key"):
            store.read("key")
        assert time.monotonic() - started < bound_s
        started = time.monotonic()  # behind the wedged call, or torch's own timeout: named either way
        with pytest.raises(StoreFailed, match=r"^the job's store .* at 127\.0\.0\.1:\d+ (did not answer within \d+s|failed) claiming"):
            store.call("claiming", store.claims.of_rank(0).compare_set, "claim/0/0", "free", "run:1")
        assert time.monotonic() - started < bound_s
    finally:
        os.kill(store.process.pid, signal.SIGCONT)
        store.close()


@pytest.mark.parametrize("own_process", [False, True])
def test_claims_spread_over_further_stores_that_workers_reach_by_their_ports(own_process):
    """``claim_stores`` 3: two more stores, served as this one is; rank r's claims on store r
    mod 3, which a worker reaches through ``claim_ports`` (as join_group connects); every
    process's CPU counted, a dead claim store named, all stopped by close."""
    store = RendezvousStore("127.0.0.1", 5.0, own_process=own_process, claim_stores=3)
    try:
        prefix = store.next_prefix()
        assert len(store.claim_ports) == 2 and store.port not in store.claim_ports
        plan = StepPlan(((0,), (1,), (2,), (3,)))
        open_step(store.claims, 0, plan)
        for rank, port in [(1, store.claim_ports[0]), (2, store.claim_ports[1]), (3, store.port)]:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
            worker = dist.PrefixStore(prefix, dist.PrefixStore(store.namespace, client))
            assert worker.get(f"claim/0/block{rank}") == b"free" and worker.get(f"claim/0/{rank}") == b"free"
            assert not worker.check([f"claim/0/block{(rank + 1) % 3}"])  # a rank on another store
        if not own_process:
            assert store.server_cpu_s() is None
            return
        assert len(store.claim_processes) == 2 and store.server_cpu_s() is not None
        dead = store.claim_processes[1]
        os.kill(dead.pid, signal.SIGKILL)
        dead._proc.wait(timeout=5)
        name = f"the job's claim store 2 at 127.0.0.1:{store.claim_ports[1]}"
        with pytest.raises(StoreProcessError, match=re.escape(f"{name} died: its process (pid {dead.pid}) was killed by signal 9")):
            store.check_alive()
    finally:
        store.close()
    assert all(p._proc.poll() is not None for p in [store.process, *store.claim_processes] if p is not None)


def test_a_claim_store_that_cannot_listen_is_named_as_one():
    store = RendezvousStore("no-such-host.invalid", 5.0, own_process=True, claim_stores=2)
    try:
        with pytest.raises(StoreProcessError, match=r"^the claim store 1's process did not start listening on no-such-host\.invalid within"):
            store.claim_ports
    finally:
        store.close()
