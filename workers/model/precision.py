"""The working precision of a worker's passes: autocast to bf16 or fp16 where the job asks."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The forward's context for ``precision`` (fp32, bf16 or fp16): ``torch.autocast`` to the
    half type (parameters, gradients and optimizer state stay fp32), or nothing."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
