"""The lease of a checkpoint namespace (``orchestrator/checkpoints/lease.py``): one live driver at a
time holds it; a lease absent or unreadable is written again; a lease is judged by its age on
the storage's clock, its driver's pid only in its PID namespace; a dead driver's lease is
waited out, a live one's refused; a lease left behind in this process is nobody's; a release
is never undone by a slow refresh. Jobs on the lease are in ``test_checkpoint_namespace.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import orchestrator.checkpoints.lease as lease_module
from orchestrator.checkpoints.lease import LEASE_FILE, NamespaceBusy, NamespaceLease
from orchestrator.checkpoints.lease_owner import LeaseOwner, Liveness
from tests.helpers.leases import lease_file, put_lease, wait_for


def _age(path: Path, seconds: float) -> None:
    """Make ``path`` read as last written ``seconds`` ago (its modification time)."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_live_lease_refuses_a_second_driver_and_a_stale_or_orphaned_one_is_taken_over(tmp_path):
    root = tmp_path / "ns"
    first = NamespaceLease(str(root), settle_s=0.0)
    first.acquire()
    second = NamespaceLease(str(root), settle_s=0.0)
    with pytest.raises(NamespaceBusy) as refused:
        second.acquire()
    message = str(refused.value)
    assert "\n" not in message and str(root / LEASE_FILE) in message and f"pid {os.getpid()} on" in message
    assert lease_file(root)["owner"]["token"] == first.owner.token  # the refused one wrote nothing
    # Not written within its stale_s (the file's age, on the storage's clock): taken over, and
    # the old holder finds out before writing.
    stale = lease_file(root)
    _age(root / LEASE_FILE, stale["stale_s"] + 1)
    second.acquire()
    assert first.check() is not None and "no longer this driver's" in first.check()
    first.release()  # not its lease any more: left alone
    assert lease_file(root)["owner"]["token"] == second.owner.token
    second.release()
    assert not (root / LEASE_FILE).exists()
    # Fresh, but its driver's process is gone from this host: taken over at once.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    orphaned = {**stale, "owner": {**stale["owner"], "pid": int(gone.stdout), "token": "0" * 16}, "refreshed": time.time()}
    put_lease(root, orphaned)
    third = NamespaceLease(str(root), settle_s=0.0)
    third.acquire()
    assert third.check() is None
    third.release()


def test_the_holder_refreshes_its_lease_and_never_writes_over_one_taken_from_it(tmp_path):
    root = tmp_path / "ns"
    lease = NamespaceLease(str(root), refresh_s=0.05, settle_s=0.0)
    lease.acquire()
    first = lease_file(root)["refreshed"]
    deadline = time.monotonic() + 10
    while lease_file(root)["refreshed"] == first and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lease_file(root)["refreshed"] > first
    taken = {**lease_file(root), "owner": {"host": "elsewhere", "pid": 1, "started": 0.0, "token": "f" * 16}}
    put_lease(root, taken)
    while lease.lost is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lease.lost is not None and "now held by pid 1 on elsewhere, started" in lease.lost
    time.sleep(0.2)
    assert lease_file(root) == taken
    lease.release()
    assert lease_file(root) == taken


def _holds(root: Path, lease: NamespaceLease) -> bool:
    try:
        return lease_file(root)["owner"]["token"] == lease.owner.token
    except (FileNotFoundError, ValueError):
        return False


def test_a_lease_read_back_absent_or_unreadable_is_written_again_not_lost(tmp_path):
    """A missing lease file (a network file system's passing ENOENT across the rename) or a
    partial one is no other driver's: the holder writes its lease again and goes on."""
    root = tmp_path / "ns"
    lease = NamespaceLease(str(root), refresh_s=0.05, settle_s=0.0)
    lease.acquire()
    try:
        for damage in (Path.unlink, lambda path: path.write_text('{"format": 1, "owner": {"ho')):
            damage(root / LEASE_FILE)
            wait_for(lambda: _holds(root, lease), "the refresher to write the lease again")
            assert lease.lost is None
    finally:
        lease.release()
    checker = NamespaceLease(str(root), refresh_s=3600, settle_s=0.0)  # now the check before a manifest, alone
    checker.acquire()
    try:
        (root / LEASE_FILE).unlink()
        assert checker.check() is None and _holds(root, checker)
    finally:
        checker.release()


def _foreign_lease(root: Path, **fields) -> dict:
    """A lease as a driver on another host writes it, refreshed every 0.1s, stale after 1.5s;
    ``fields`` replace its own."""
    root.mkdir(parents=True, exist_ok=True)
    lease = {
        "format": 1, "owner": {"host": "elsewhere", "pid": 1, "started": 0.0, "token": "e" * 16}, "refreshed": time.time(),
        "refresh_s": 0.1, "stale_s": 1.5, **fields,
    }
    put_lease(root, lease)
    return lease


def test_a_lease_is_judged_by_its_age_on_the_storage_and_its_pid_only_in_its_pid_namespace(tmp_path):
    """The writer's clock says nothing (hosts disagree): a lease written now whose writer's
    clock is an hour behind is watched as live (refused once written again), one written long
    ago whose writer's clock ran ahead is stale and taken at once. A gone pid frees a lease
    only if it was written in this PID namespace: containers that share a host name cannot
    see each other's processes."""
    root = tmp_path / "ns"
    written = _foreign_lease(root, refreshed=time.time() - 3600)
    other = NamespaceLease(str(root), settle_s=0.0)
    with ThreadPoolExecutor(1) as pool:
        taking = pool.submit(other.acquire)
        time.sleep(0.3)
        put_lease(root, {**written, "refreshed": time.time() - 3599})  # its driver refreshes it
        with pytest.raises(NamespaceBusy, match="in use by another driver .*written again while this driver waited"):
            taking.result(timeout=30)
    put_lease(root, {**written, "refreshed": time.time() + 3600})
    _age(root / LEASE_FILE, written["stale_s"] + 1)
    waits: list[str] = []
    other.acquire(waits.append)
    assert waits == [] and lease_file(root)["owner"]["token"] == other.owner.token
    other.release()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    here = LeaseOwner.of_this_process()
    assert LeaseOwner(here.host, int(gone.stdout), 0.0, "0" * 16, here.pid_ns).liveness() is Liveness.GONE
    for pid_ns in ("another-boot/4:4026531836", None):  # another container; a lease that does not say
        assert LeaseOwner(here.host, int(gone.stdout), 0.0, "0" * 16, pid_ns).liveness() is Liveness.UNKNOWN


def test_a_dead_drivers_lease_is_waited_out_and_a_live_ones_refused_once_it_refreshes(tmp_path):
    """A driver on another host (a Tune trial retried after its node was lost, a restarted
    pod): nothing here can tell whether it is alive, so its lease is watched. Unrefreshed, it is
    taken over once the storage last saw it written its stale_s ago, the wait reported; a
    driver that refreshes it is alive, and refused well before then, saying what to do."""
    root = tmp_path / "ns"
    lease = _foreign_lease(root)
    waits: list[str] = []
    started = time.monotonic()
    taker = NamespaceLease(str(root), settle_s=0.0)
    taker.acquire(waits.append)
    assert time.monotonic() - started >= 1.0 and lease_file(root)["owner"]["token"] == taker.owner.token
    assert len(waits) == 1 and "held by pid 1 on elsewhere" in waits[0] and "waiting up to" in waits[0]
    taker.release()
    _foreign_lease(root)
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(0.1):
            put_lease(root, {**lease, "refreshed": time.time()})

    refresher = threading.Thread(target=refresh)
    refresher.start()
    started = time.monotonic()
    try:
        with pytest.raises(NamespaceBusy) as refused:
            NamespaceLease(str(root), settle_s=0.0).acquire()
    finally:
        stop.set()
        refresher.join(timeout=10)
    assert time.monotonic() - started < 1.0
    message = str(refused.value)
    assert "\n" not in message and "pid 1 on elsewhere" in message and "let that driver end (or stop it) and run this again" in message
    assert f"taken over 2s after its last write, and deleting {root / LEASE_FILE} frees it at once" in message


def test_a_lease_left_behind_in_this_process_is_nobodys(tmp_path, monkeypatch):
    """A driver whose release could not delete its lease (the storage failed just then) leaves
    it naming this process: a retry in the same process takes it at once rather than being
    refused in the name of its own pid. A lease this process still holds is refused at once."""
    root = tmp_path / "ns"
    first = NamespaceLease(str(root), settle_s=0.0)
    first.acquire()
    with pytest.raises(NamespaceBusy, match=f"pid {os.getpid()} on .*held by a driver in this very process"):
        NamespaceLease(str(root), settle_s=0.0).acquire()

    def broken(relpath: str) -> None:
        raise OSError("storage unreachable")

    monkeypatch.setattr(first.storage, "delete_file", broken)
    first.release()
    assert lease_file(root)["owner"]["token"] == first.owner.token
    retry = NamespaceLease(str(root), settle_s=0.0)
    started = time.monotonic()
    retry.acquire()
    assert time.monotonic() - started < 1.0 and lease_file(root)["owner"]["token"] == retry.owner.token
    retry.release()


def test_a_refresher_write_slower_than_release_never_brings_the_lease_back(tmp_path, monkeypatch):
    """The refresher is inside a write of the lease (a storage call slower than refresh_s) when
    the driver releases it: the write lands first and the lease is then deleted; none follows."""
    root = tmp_path / "ns"
    lease = NamespaceLease(str(root), refresh_s=0.05, settle_s=0.0)
    lease.acquire()
    writing, write = threading.Event(), lease.storage.write_bytes

    def slow(relpath: str, data: bytes) -> str:
        if relpath == LEASE_FILE and threading.current_thread() is lease._refresher:
            writing.set()
            time.sleep(0.5)
        return write(relpath, data)

    monkeypatch.setattr(lease.storage, "write_bytes", slow)
    assert writing.wait(10)
    lease.release()
    assert lease._refresher is not None
    lease._refresher.join(timeout=10)
    time.sleep(0.2)
    assert not (root / LEASE_FILE).exists()


def test_a_lease_on_remote_storage_waits_longer_to_read_back():
    local, remote = NamespaceLease("/tmp/ns"), NamespaceLease("mock:///ns")
    assert local.settle_s == lease_module.SETTLE_S < remote.settle_s == lease_module.REMOTE_SETTLE_S
