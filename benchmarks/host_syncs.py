"""Counting the host syncs of a region of code: each time the host waits for a device.

A plain PyTorch training loop never waits for the GPU: the host queues step after step and
runs ahead. Each read of a device value (``.item()``, ``float()``, ``bool()`` of a tensor,
``.tolist()``, ``.cpu()``), each result whose size depends on values (``nonzero``), each
blocking copy between host and device and each ``synchronize`` makes it wait, and the GPU
then idles while the host queues what follows. ``HostSyncs`` counts them over a region, with
the call site of each: ops through a ``TorchDispatchMode``, reads and moves to the host
through patched ``Tensor`` methods (``tolist``, ``numpy`` and ``cpu`` count on the CPU too,
where no copy crosses a device: code calls them to read a value on the host), synchronizations through patched ``torch.cuda`` calls.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
# Ops that hand a device's value to the host (item, float, int and bool of a tensor all end
# in _local_scalar_dense), or whose output size depends on the values.
READ_OPS = frozenset({"aten._local_scalar_dense", "aten.equal", "aten.nonzero", "aten.masked_select"})


def _site() -> str:
    """The innermost frames of this repository's code (not this module's) calling now."""
    frames = [f for f in traceback.extract_stack() if f.filename.startswith(str(ROOT)) and not f.filename.endswith("host_syncs.py")]
    frames = [f for f in frames if "/site-packages/" not in f.filename and "/.venv/" not in f.filename]
    return " < ".join(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno}" for f in reversed(frames[-2:])) or "?"


def _to_host(tensor: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` is a blocking copy from a device to the host."""
    device = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
    to_host = device is not None and torch.device(device).type == "cpu"
    return to_host and tensor.device.type != "cpu" and not kwargs.get("non_blocking")


class HostSyncs(TorchDispatchMode):
    """``with HostSyncs() as syncs: ...`` then ``syncs.count`` and ``syncs.sites`` (a Counter
    of ``"what @ file:line < file:line"``). Not reentrant; patches global methods while active."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()
        self._inside = 0  # inside a counted call: what it dispatches is that one sync
        self._restore: list[tuple[Any, str, Any]] = []

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def _note(self, what: str) -> None:
        if self._inside:
            return
        self.sites[f"{what} @ {_site()}"] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in READ_OPS:
            self._note(name)
        elif name == "aten.copy_" and not kwargs.get("non_blocking", args[2] if len(args) > 2 else False):
            dst, src = args[0], args[1]
            if isinstance(src, torch.Tensor) and dst.device != src.device:
                self._note(f"blocking copy {src.device.type}->{dst.device.type}")
        return func(*args, **kwargs)

    def _patch(self, owner: Any, name: str, counts: Callable[..., bool]) -> None:
        original = getattr(owner, name)
        mode = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            if not counts(*args, **kwargs):
                return original(*args, **kwargs)
            mode._note(f"{getattr(owner, '__name__', owner)}.{name}")
            mode._inside += 1
            try:
                return original(*args, **kwargs)
            finally:
                mode._inside -= 1

        self._restore.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self) -> "HostSyncs":
        always = lambda *args, **kwargs: True  # noqa: E731
        self._patch(torch.Tensor, "tolist", always)
        self._patch(torch.Tensor, "numpy", always)
        self._patch(torch.Tensor, "cpu", always)
        self._patch(torch.Tensor, "to", lambda tensor, *args, **kwargs: _to_host(tensor, args, kwargs))
        self._patch(torch.cuda, "synchronize", always)
        self._patch(torch.cuda.Stream, "synchronize", always)
        self._patch(torch.cuda.Event, "synchronize", always)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for owner, name, original in reversed(self._restore):
                setattr(owner, name, original)
            self._restore = []
