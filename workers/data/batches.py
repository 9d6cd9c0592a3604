"""A step's batches: samples gathered by index, and moved to the worker's device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from workers.runtime.devices import map_tensors


def fetch_batch(dataset: Dataset, indices: np.ndarray, collate: Callable[[list[Any]], Any] | None = None) -> Any:
    """Gather samples by index: one indexing op for a TensorDataset (without a ``collate``),
    else through ``collate`` (default: torch's ``default_collate``, which stacks tensors, tuples
    and dicts of tensors) the samples of ``dataset.__getitems__`` (torch's batched fetch, where
    the dataset has one) or item by item."""
    tensors = getattr(dataset, "tensors", None)
    if tensors is not None and collate is None:
        idx = torch.from_numpy(indices)
        return tuple(t[idx] for t in tensors)
    wanted = [int(i) for i in indices]
    getitems = getattr(dataset, "__getitems__", None)
    samples = getitems(wanted) if getitems is not None else [dataset[i] for i in wanted]
    return (collate or default_collate)(samples)


def move_to(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or tuples, lists and dicts of them) on ``device``; anything else as
    is. The copies do not block the host: from pinned memory (``workers/runtime/devices.py``,
    ``host_batch``) they overlap with compute."""
    return map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=True))
