"""CUDA streams as far as ordering goes, on the CPU: ``StreamMarks`` over fake streams.

A stream is a list of items in queueing order, each something that is done or not yet: a
gate (``Gate``: a long kernel, e.g. the rest of a backward, done when the test opens it), a
mark another stream's work was made to wait for, or an NCCL launch's work
(``FakeProcessGroupNCCL`` with these streams: a launch starts only once everything queued on
the launching thread's current stream before it is done, and its ``wait()`` queues the work
on that stream). A mark (``record``) covers every item queued on its stream so far: it is
done once they all are. Each thread's current stream is the device's default stream until it
``use``s one of its own, as in CUDA.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


class Gate:
    """An item done once ``open()`` is called; ``on_open`` callbacks run then (a fake NCCL
    world re-checks which launches may start)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.on_open: list[Callable[[], None]] = []

    def open(self) -> None:
        self._open.set()
        for callback in self.on_open:
            callback()

    def done(self) -> bool:
        return self._open.is_set()


@dataclass(eq=False)
class FakeStream:
    name: str
    items: list[object] = field(default_factory=list)  # each has done() -> bool


@dataclass(frozen=True, eq=False)
class Mark:
    """Every item queued on ``stream`` when it was recorded."""

    stream: FakeStream
    items: tuple[object, ...]

    def done(self) -> bool:
        return all(item.done() for item in self.items)  # type: ignore[attr-defined]


class FakeDeviceStreams:
    """One fake device's streams; a ``StreamMarks`` (``workers/runtime/devices.py``)."""

    def __init__(self) -> None:
        self.default = FakeStream("default")
        self._numbers = itertools.count(1)
        self._local = threading.local()

    def current(self) -> FakeStream:
        return getattr(self._local, "stream", self.default)

    def record(self, stream: object = None) -> Mark:
        stream = self.current() if stream is None else stream
        assert isinstance(stream, FakeStream)
        return Mark(stream, tuple(stream.items))

    def wait(self, mark: object) -> None:
        assert isinstance(mark, Mark)
        self.current().items.append(mark)

    def done(self, mark: object) -> bool:
        assert isinstance(mark, Mark)
        return mark.done()

    def own_stream(self) -> FakeStream:
        return FakeStream(f"stream-{next(self._numbers)}")

    def use(self, stream: object) -> None:
        assert isinstance(stream, FakeStream)
        self._local.stream = stream

    def queue(self, item: object) -> None:
        """Queue ``item`` (a kernel: a ``Gate``, a work) on the calling thread's current stream."""
        self.current().items.append(item)
