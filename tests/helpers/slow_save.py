"""A serializer slowed on purpose: ``torch.save`` (and a checkpoint part's ``encode``) taking time in proportion to the floating-point
tensor data it writes, as saving a large optimizer state does. What a generic optimizer's
checkpoint or join costs on the thread that trains shows as seconds, on a model small enough
for tests."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Callable

import torch


def float_bytes(value: Any) -> int:
    """The bytes of floating-point tensor data in ``value`` (tensors in dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() if value.is_floating_point() else 0
    if isinstance(value, Mapping):
        return sum(float_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(float_bytes(v) for v in value)
    return 0


def slowed(save: Callable[..., Any], bytes_per_s: float, on_call: Callable[[int], None] | None = None) -> Callable[..., Any]:
    """``save`` (``torch.save``, a part file's ``encode``), sleeping first a second per
    ``bytes_per_s`` bytes of floating-point data in its arguments; ``on_call(bytes)`` is told
    of each call before it sleeps."""

    def slow_save(*args: Any, **kwargs: Any) -> Any:
        size = float_bytes(args)
        if on_call is not None:
            on_call(size)
        time.sleep(size / bytes_per_s)
        return save(*args, **kwargs)

    return slow_save


def make_model_slow_to_save(hidden: int = 32, bytes_per_s: float = 4000.0) -> torch.nn.Module:
    """The digits model, built by a worker whose serializers (``torch.save``, and the part
    files' ``encode``) are ``slowed`` (a model factory runs in the worker process only, so the
    driver's are untouched)."""
    from ringleader_examples.digits import make_model
    from workers.checkpoint import tensor_file

    if not getattr(torch.save, "slowed", False):
        torch.save = slowed(torch.save, bytes_per_s)
        torch.save.slowed = True  # type: ignore[attr-defined]
        tensor_file.encode = slowed(tensor_file.encode, bytes_per_s)
    return make_model(hidden=hidden)
