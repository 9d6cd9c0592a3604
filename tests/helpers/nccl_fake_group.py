"""A process group with NCCL's semantics, in one process: ranks are threads, no GPU.

``FakeProcessGroupNCCL`` stands where ``torch.distributed.ProcessGroupNCCL`` does (same
constructor, ``Options``, ``supports_coalescing``, ``_start_coalescing``/``_end_coalescing``,
``send``/``recv``/``allreduce``/``broadcast``, ``eager_connect_single_device``, ``abort``,
``shutdown``), so the code under test drives it exactly as it drives a real one. What it models:

- **Streams.** Every launch (one op, or one coalesced group) is queued on a stream of its rank
  and starts only when everything before it there has completed: collectives and groups on
  the rank's main stream; an ungrouped ``send``/``recv`` on the rank's stream for that peer
  (NCCL gives each pair of ranks its own communicator and stream for single p2p ops).
- **Device streams** (optional, ``streams``: ``tests/helpers/fake_streams.py``). A launch
  also waits for everything queued on the launching thread's current stream before it (NCCL
  makes its stream wait on the caller's), and ``wait()`` queues the work on the waiting
  thread's current stream. ``FakeNcclWorld.nudge`` re-checks what may start (after a gate
  on a stream opened).
- **Matching.** Between an ordered pair of ranks the k-th send posted matches the k-th
  receive posted, whatever the tags (NCCL ignores them). A send and its receive complete
  together, once both of their launches have started; the data is copied then, and a send
  and receive that differ in dtype or element count fail both launches instead (NCCL would
  hang or corrupt memory). A collective completes once every rank's launch of it has
  started. So two ranks that both send before they receive, ungrouped, deadlock; the ops of
  one group start together and do not.
- **Communicators form lazily and blockingly.** The main communicator is created by
  ``eager_connect_single_device`` or else by the first collective or group; a pair's
  communicator (single p2p) by the pair's first ungrouped send or receive. Creating one
  blocks the calling thread until every rank (both of the pair) has arrived, at most the
  creation's wait bound (then RuntimeError): the group's timeout, or with a non-blocking
  config (``config.blocking = False``, as ours) TORCH_NCCL_NONBLOCKING_TIMEOUT (read when the
  group is made; torch's default 30 min), and then ``eager_connect_single_device`` only
  arrives: the wait comes at the first collective or group, as torch's ``getNcclComm`` waits
  for a non-blocking communicator to become ready.
- **Abort waits for a creation.** Each rank has one communicator lock (torch: each
  ``NCCLComm``'s mutex), held for the whole of a creation's wait (torch: ``getNcclComm`` ->
  ``waitReady``) and taken first by ``abort()`` and ``shutdown()`` (``NCCLComm::abort``
  takes the mutex): an abort during a creation returns only once the creation's wait ended.
  Otherwise ``abort()`` fails every launch of its rank at once; ``shutdown()`` waits (bounded
  like a creation) until they have completed, then ends the communicators, raising
  RuntimeError if they did not.
- **Work.** ``is_completed()`` and ``wait()`` as NCCL's: ``wait()`` never blocks the CPU and
  raises if the work ended in an error (its rank was aborted, a mismatched message).

A deadlock therefore never hangs a test: it shows as work that never completes, which
``CommGroup``'s polling turns into CollectiveTimeout, or as a blocked rendezvous that ends in
RuntimeError at its wait bound. ``FakeNcclWorld`` is the shared state of one generation.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.helpers.fake_streams import FakeDeviceStreams, Mark

MAIN = "main"  # the key of a rank's main stream (its other streams are keyed by peer rank)
NONBLOCKING_TIMEOUT_DEFAULT_S = 30 * 60  # torch's, where TORCH_NCCL_NONBLOCKING_TIMEOUT is unset


class FakeWork:
    """NCCL-like work: ``wait()`` never blocks; with device streams it orders the waiting
    thread's current stream after the work (queues it there), as NCCL's does."""

    def __init__(self, streams: FakeDeviceStreams | None = None) -> None:
        self.completed = False
        self.error: str | None = None
        self.streams = streams

    def is_completed(self) -> bool:
        return self.completed or self.error is not None

    def done(self) -> bool:
        """As an item of a fake stream: done once completed, or ended in an error (an aborted
        NCCL kernel exits, and the stream goes on behind it)."""
        return self.completed or self.error is not None

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.error is not None:
            raise RuntimeError(self.error)
        if self.streams is not None:
            self.streams.queue(self)
        return True


@dataclass(eq=False)
class _Op:
    kind: str  # send, recv, allreduce, broadcast
    rank: int
    tensor: torch.Tensor
    peer: int = -1  # send: destination; recv: source
    index: int = -1  # its place among the pair's sends/receives, or the rank's collectives
    reduce_op: object = None
    root: int = -1
    launch: _Launch | None = None
    done: bool = False


@dataclass(eq=False)
class _Launch:
    stream: tuple[int, object]
    ops: list[_Op]
    work: FakeWork = field(default_factory=FakeWork)
    after: Mark | None = None  # with device streams: the launching thread's stream when launched

    def started(self) -> bool:
        return self.after is None or self.after.done()


class FakeNcclWorld:
    """The ranks of one fake NCCL group: its streams, posted ops and rendezvous, under one lock.
    ``construction_gate``: if set, constructors wait (bounded) until it is (a slow CUDA init)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.groups: dict[int, FakeProcessGroupNCCL] = {}
        self.construction_gate: threading.Event | None = None
        self.connected: set[int] = set()  # ranks arrived at the main communicator's creation
        self.pairs: dict[frozenset[int], set[int]] = defaultdict(set)
        self.blocked: set[int] = set()  # ranks whose thread waits in a communicator's creation
        self.streams: dict[tuple[int, object], deque[_Launch]] = defaultdict(deque)
        self.sends: dict[tuple[int, int], list[_Op]] = defaultdict(list)  # (src, dst): in posting order
        self.receives: dict[tuple[int, int], list[_Op]] = defaultdict(list)
        self.collectives: dict[int, list[_Op]] = defaultdict(list)

    def nudge(self) -> None:
        """Start and complete what now can (something a launch waited for on a stream is done)."""
        with self.cond:
            self.progress()

    def pending(self, rank: int) -> int:
        """Launches of ``rank`` not ended, plus 1 if its thread waits in a rendezvous."""
        with self.cond:
            queued = sum(len(q) for (r, _), q in self.streams.items() if r == rank)
            return queued + (rank in self.blocked)

    def _running(self, op: _Op) -> bool:
        launch = op.launch
        queue = self.streams.get(launch.stream) if launch is not None else None
        return bool(queue) and queue[0] is launch and launch.work.error is None and launch.started()

    def _partner(self, op: _Op) -> _Op | None:
        if op.kind == "send":
            matches = self.receives[(op.rank, op.peer)]
        else:
            matches = self.sends[(op.peer, op.rank)]
        return matches[op.index] if op.index < len(matches) else None

    def _collective_peers(self, op: _Op) -> list[_Op] | None:
        ops = [self.collectives[r][op.index] for r in range(self.size) if len(self.collectives[r]) > op.index]
        if len(ops) < self.size or not all(self._running(o) for o in ops):
            return None
        if any(o.kind != op.kind or o.tensor.shape != op.tensor.shape or o.tensor.dtype != op.tensor.dtype for o in ops):
            raise AssertionError(f"ranks disagree on collective #{op.index}: {[o.kind for o in ops]}")
        return ops

    def progress(self) -> None:
        """Complete every op whose partners have started, until nothing more can (lock held)."""
        changed = True
        while changed:
            changed = False
            for queue in list(self.streams.values()):
                if not queue or queue[0].work.error is not None or not queue[0].started():
                    continue
                for op in queue[0].ops:
                    if op.done:
                        continue
                    if op.kind in ("send", "recv"):
                        partner = self._partner(op)
                        if partner is None or not self._running(partner):
                            continue
                        send, receive = (op, partner) if op.kind == "send" else (partner, op)
                        mismatch = _mismatch(send, receive)
                        if mismatch is not None:
                            send.launch.work.error = receive.launch.work.error = mismatch  # type: ignore[union-attr]
                        else:
                            receive.tensor.copy_(send.tensor)
                            op.done = partner.done = True
                    else:
                        ops = self._collective_peers(op)
                        if ops is None:
                            continue
                        _reduce(ops)
                        for o in ops:
                            o.done = True
                    changed = True
            for queue in self.streams.values():
                while queue and all(op.done for op in queue[0].ops):
                    queue.popleft().work.completed = True
                    changed = True
        self.cond.notify_all()


def _mismatch(send: _Op, receive: _Op) -> str | None:
    """Why ``receive`` cannot take ``send``'s message (``copy_`` would broadcast or convert it),
    or None."""
    sent, taken = send.tensor, receive.tensor
    if sent.dtype == taken.dtype and sent.numel() == taken.numel():
        return None
    return (
        f"mismatched message: rank {send.rank} sent {sent.numel()} x {sent.dtype} to rank {receive.rank}, "
        f"whose matching receive takes {taken.numel()} x {taken.dtype}"
    )


def _reduce(ops: list[_Op]) -> None:
    op = ops[0]
    if op.kind == "broadcast":
        value = ops[op.root].tensor.clone()
    elif op.reduce_op == dist.ReduceOp.MAX:
        value = torch.stack([o.tensor for o in ops]).amax(0)
    elif op.reduce_op == dist.ReduceOp.SUM:
        value = torch.stack([o.tensor for o in ops]).sum(0)
    else:
        raise AssertionError(f"the fake reduces SUM and MAX only, not {op.reduce_op}")
    for o in ops:
        o.tensor.copy_(value)


class FakeProcessGroupNCCL:
    """Rank ``rank`` of ``world`` (passed where the real class takes its store)."""

    supports_coalescing = True

    class Options:
        def __init__(self) -> None:
            self._timeout = timedelta(minutes=10)
            self.config = SimpleNamespace(blocking=True)

    def __init__(
        self,
        world: FakeNcclWorld,
        rank: int,
        size: int,
        options: FakeProcessGroupNCCL.Options,
        streams: FakeDeviceStreams | None = None,
    ) -> None:
        assert size == world.size, f"world of {world.size} ranks, group of {size}"
        self.world, self.rank, self.size = world, rank, size
        #: The rank's device streams, if modelled: a launch waits for the launching thread's.
        self.device_streams = streams
        self.options = options
        self.timeout_s = options._timeout.total_seconds()
        nonblocking = not options.config.blocking
        #: How long a communicator's creation waits for the others (then RuntimeError).
        nonblocking_s = float(os.environ.get("TORCH_NCCL_NONBLOCKING_TIMEOUT") or NONBLOCKING_TIMEOUT_DEFAULT_S)
        self.creation_wait_s = nonblocking_s if nonblocking else self.timeout_s
        self.aborted = False
        self.shut_down = False  # by shutdown(): its launches done, its communicators ended
        self.device: torch.device | None = None  # as passed to eager_connect_single_device
        # torch's NCCLComm mutex: held during a creation's wait, taken first by abort/shutdown.
        self.comm_lock = threading.RLock()
        self.main_connected = False
        self.pairs_connected: set[int] = set()
        self._coalescing: list[_Op] | None = None
        if world.construction_gate is not None and not world.construction_gate.wait(self.timeout_s):
            raise RuntimeError(f"rank {rank}: construction timed out")
        with world.cond:
            world.groups[rank] = self

    # Communicators

    def _rendezvous(self, arrive: Callable[[], None], ready: Callable[[], bool], what: str) -> None:
        world = self.world
        with self.comm_lock, world.cond:  # held throughout: abort() waits for this to end
            if self.aborted or self.shut_down:
                raise RuntimeError(f"rank {self.rank}: NCCL communicator was aborted")
            arrive()
            world.cond.notify_all()
            world.blocked.add(self.rank)
            try:
                world.cond.wait_for(ready, timeout=self.creation_wait_s)
            finally:
                world.blocked.discard(self.rank)
            if not ready():
                raise RuntimeError(f"rank {self.rank}: creating {what} timed out after {self.creation_wait_s:.0f}s")

    def _connect_main(self) -> None:
        if not self.main_connected:
            world = self.world
            self._rendezvous(lambda: world.connected.add(self.rank), lambda: len(world.connected) == self.size, "the communicator")
            self.main_connected = True

    def _connect_pair(self, peer: int) -> None:
        if peer not in self.pairs_connected:
            arrived = self.world.pairs[frozenset((self.rank, peer))]
            self._rendezvous(lambda: arrived.add(self.rank), lambda: peer in arrived, f"the pair communicator with {peer}")
            self.pairs_connected.add(peer)

    def eager_connect_single_device(self, device: torch.device | None) -> None:
        self.device = device
        if self.options.config.blocking:
            self._connect_main()
            return
        with self.world.cond:  # non-blocking: arrive now; the first collective or group waits
            self.world.connected.add(self.rank)
            self.world.cond.notify_all()

    # Launches

    def _launch(self, stream: object, ops: list[_Op]) -> FakeWork:
        world = self.world
        streams = self.device_streams
        with world.cond:
            launch = _Launch((self.rank, stream), ops, FakeWork(streams), streams.record() if streams is not None else None)
            if self.aborted or self.shut_down:
                launch.work.error = f"rank {self.rank}: NCCL communicator was aborted"
                return launch.work
            for op in ops:
                op.launch = launch
                if op.kind == "send":
                    posted = world.sends[(self.rank, op.peer)]
                elif op.kind == "recv":
                    posted = world.receives[(op.peer, self.rank)]
                else:
                    posted = world.collectives[self.rank]
                op.index = len(posted)
                posted.append(op)
            world.streams[launch.stream].append(launch)
            world.progress()
            return launch.work

    def _p2p(self, kind: str, tensors: list[torch.Tensor], peer: int) -> FakeWork | None:
        op = _Op(kind, self.rank, tensors[0], peer=peer)
        if self._coalescing is not None:
            self._coalescing.append(op)
            return None  # a coalesced op's work is the group's, from _end_coalescing
        self._connect_pair(peer)
        return self._launch(peer, [op])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> FakeWork | None:
        return self._p2p("send", tensors, dst)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> FakeWork | None:
        return self._p2p("recv", tensors, src)

    def _start_coalescing(self) -> None:
        assert self._coalescing is None, "coalescing already started"
        self._coalescing = []

    def _end_coalescing(self) -> FakeWork:
        ops, self._coalescing = self._coalescing, None
        assert ops is not None, "_end_coalescing without _start_coalescing"
        self._connect_main()
        return self._launch(MAIN, ops)

    def allreduce(self, tensors: list[torch.Tensor], options: dist.AllreduceOptions) -> FakeWork:
        self._connect_main()
        return self._launch(MAIN, [_Op("allreduce", self.rank, tensors[0], reduce_op=options.reduceOp)])

    def broadcast(self, tensors: list[torch.Tensor], options: dist.BroadcastOptions) -> FakeWork:
        self._connect_main()
        return self._launch(MAIN, [_Op("broadcast", self.rank, tensors[0], root=options.rootRank)])

    def _queues(self) -> list[deque[_Launch]]:
        return [queue for (rank, _), queue in self.world.streams.items() if rank == self.rank]

    def abort(self) -> None:
        """End this rank's communicators: its launches fail. Waits for a creation under way."""
        world = self.world
        with self.comm_lock, world.cond:
            self.aborted = True
            for queue in self._queues():
                for launch in queue:
                    launch.work.error = f"rank {self.rank}: NCCL communicator was aborted"
                queue.clear()
            world.progress()

    def shutdown(self) -> None:
        """Flush, then end this rank's communicators: waits (at most a creation's wait bound)
        until its launches have completed; RuntimeError if they did not. Waits for a creation
        under way."""
        world = self.world
        with self.comm_lock, world.cond:
            if self.aborted:
                return
            if not world.cond.wait_for(lambda: not any(self._queues()), timeout=self.creation_wait_s):
                raise RuntimeError(f"rank {self.rank}: shutdown timed out flushing its NCCL operations")
            self.shut_down = True


def fake_options(timeout_s: float) -> FakeProcessGroupNCCL.Options:
    options = FakeProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout_s)
    return options


def on_ranks(size: int, work: Callable[[int], object], limit_s: float = 120.0) -> list[object]:
    """Run ``work(rank)`` on one thread per rank (a rank's process) and return what each
    returned or raised. Fails if a thread is still running after ``limit_s``: no hung test."""
    outcomes: list[object] = [None] * size

    def run(rank: int) -> None:
        try:
            outcomes[rank] = work(rank)
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            outcomes[rank] = err

    threads = [threading.Thread(target=run, args=(rank,), name=f"fake-rank-{rank}", daemon=True) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(limit_s)
        assert not thread.is_alive(), f"{thread.name} still running after {limit_s}s"
    return outcomes
