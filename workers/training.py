"""Model-side building blocks of a worker: shard loss, batches, flat parameters and gradients."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate

def per_sample_loss(kind: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Loss of each sample (shape ``[batch]``), averaged over any non-batch positions.

    ``cross_entropy`` takes logits ``[batch, ..., classes]`` and class ids ``[batch, ...]`` (so a
    language model's per-token loss is averaged within each sequence); ``mse`` takes matching
    shapes.
    """
    if kind == "cross_entropy":
        losses = F.cross_entropy(
            output.reshape(-1, output.shape[-1]), target.reshape(-1), reduction="none"
        )
    elif kind == "mse":
        losses = F.mse_loss(output, target.to(output.dtype), reduction="none")
    else:
        raise ValueError(f"unknown loss {kind!r}")
    return losses.reshape(output.shape[0], -1).mean(dim=1)


def fetch_batch(dataset: Dataset, indices: np.ndarray) -> Any:
    """Gather samples by index; one indexing op for a TensorDataset, else collate item by item."""
    tensors = getattr(dataset, "tensors", None)
    if tensors is not None:
        idx = torch.from_numpy(indices)
        return tuple(t[idx] for t in tensors)
    return default_collate([dataset[int(i)] for i in indices])


def evaluate_model(model: torch.nn.Module, dataset: Dataset, loss: str, batch: int = 1024) -> dict[str, float]:
    """Mean per-sample loss over ``dataset`` (and accuracy over all positions, for
    cross-entropy), without gradients; leaves the model in the mode it found it."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_total, correct, positions = 0.0, 0, 0
    with torch.no_grad():
        for lo in range(0, len(dataset), batch):
            indices = np.arange(lo, min(lo + batch, len(dataset)))
            inputs, targets = move_to(fetch_batch(dataset, indices), device)
            output = model(inputs)
            loss_total += float(per_sample_loss(loss, output, targets).sum())
            if loss == "cross_entropy":
                correct += int((output.argmax(dim=-1) == targets).sum())
                positions += targets.numel()
    model.train(was_training)
    metrics = {"loss": loss_total / max(len(dataset), 1), "samples": float(len(dataset))}
    if positions:
        metrics["accuracy"] = correct / positions
    return metrics


def move_to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return type(batch)(move_to(b, device) for b in batch)


class FlatParameters:
    """A model's trainable parameters and their gradients, each as views into one flat buffer.

    ``values`` holds the parameters back to back, in parameter order; ``buffer`` holds
    ``[extra | gradients]`` in the same order, ``grads`` being its gradient part. Backward
    accumulates into ``param.grad`` in place, so the buffer always holds the sum of every
    shard's gradient since the last ``zero()``, ready to all-reduce without copies (DDP's
    ``gradient_as_bucket_view`` trick), and one optimizer call steps ``values`` from ``grads``.
    The ``extra`` slots in front let per-step bookkeeping (shard census, loss, sample count)
    ride along in the bucket that holds the first parameters, which is reduced last.
    Parameters without ``requires_grad`` are left out.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], extra: int = 0) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"mixed parameter dtypes are not supported: {sorted(map(str, dtypes))}")
        self.numel = sum(p.numel() for p in self.params)
        first = self.params[0]
        self.values = torch.empty(self.numel, dtype=first.dtype, device=first.device)
        self.buffer = torch.zeros(extra + self.numel, dtype=first.dtype, device=first.device)
        self.extra = self.buffer[:extra]
        self.grads = self.buffer[extra:]
        #: ``(start, end)`` of each parameter's gradient in ``buffer``, in parameter order.
        self.ranges: list[tuple[int, int]] = []
        self._views = []
        offset = 0
        with torch.no_grad():
            for p in self.params:
                end = offset + p.numel()
                self.values[offset:end].copy_(p.reshape(-1))
                p.data = self.values[offset:end].view_as(p)
                view = self.grads[offset:end].view_as(p)
                p.grad = view
                self._views.append(view)
                self.ranges.append((extra + offset, extra + end))
                offset = end

    def zero(self) -> None:
        """Zero the buffer; raises if something replaced a ``.grad`` (e.g. ``set_to_none``)."""
        for p, view in zip(self.params, self._views):
            if p.grad is not view:
                raise RuntimeError("a parameter's .grad no longer views the flat gradient buffer")
        self.buffer.zero_()
