"""What a training pass minimises: the job's loss on a batch, as a sum and the weight that
normalises it (docs/architecture.md, "Losses").

A loss is called as ``fn(model, batch, **kwargs)`` and returns either

* per-sample losses, shape ``[n]`` for the ``n`` samples of the batch: the sum is the pass's
  loss and ``n`` its weight, so the step's loss is the mean over the step's samples; or
* a pair ``(loss_sum, weight)``: a scalar tensor and a number (or scalar tensor) >= 0.

Either way the step's gradient is the sum over all shards of the gradients of the loss sums,
divided by the sum of the weights over all shards of the step, which travels in the reduced
buffer with the gradient. A per-token mean over the whole global batch (padding and
``ignore_index`` excluded) is thus exact whichever worker computed which shard.

The precondition: ``loss_sum`` and ``weight`` are sums of per-sample contributions, so a
batch's are the sums of its samples' whatever else is in the batch. (A weight counting padded
positions of a pad-to-longest collate is not: it would depend on which samples share a pass.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from jobspec import targets as factories

IGNORE_INDEX = -100  # torch's and Hugging Face's default


class ScalarLossError(ValueError):
    """A loss returned one number for the whole batch (a mean, most likely): the step's
    mean over all shards cannot be rebuilt from shard means, so the contract refuses it."""


@dataclass(frozen=True)
class BatchLoss:
    """A batch's loss: ``total`` (a scalar tensor to backpropagate), the ``weight`` it is
    normalised by (a number, or, for the built-in token losses, a float64 0-dim tensor on the
    batch's device: counting kept tokens on the host would sync it with the device every
    pass; ``float()`` it where a number is needed), and, for the built-in classification
    losses, a function counting how many of the weighed predictions were ``correct`` (for eval
    accuracy; training never pays for it)."""

    total: torch.Tensor
    weight: float | torch.Tensor
    correct: Callable[[], float] | None = None


def split_batch(batch: Any, loss: str) -> tuple[Any, torch.Tensor]:
    """``(inputs, targets)`` of a tuple batch, or of a dict batch: every key but ``labels``
    are the model's keyword inputs. Raises ValueError for any other shape."""
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise ValueError(f"loss {loss!r}: a dict batch needs a 'labels' entry, got keys {sorted(batch)}")
        return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(f"loss {loss!r}: expected an (inputs, targets) pair or a dict with 'labels', got {_describe(batch)}")


def logits_of(model: torch.nn.Module, inputs: Any) -> torch.Tensor:
    """Call ``model`` on ``inputs`` (keyword arguments if a dict); the output tensor, or the
    ``logits`` of a Hugging Face style output object, or the first element of a tuple."""
    output = model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ValueError(f"the model returned {_describe(output)}: expected a tensor, or an object with .logits")


def _token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> BatchLoss:
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    flat_targets = targets.reshape(-1)
    if flat_logits.shape[0] != flat_targets.shape[0]:
        raise ValueError(
            f"cross-entropy: logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)} "
            "(expected logits [..., classes] and targets [...])"
        )
    kept = flat_targets != ignore_index
    total = F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index, reduction="sum")

    def correct() -> float:
        return float(((flat_logits.detach().argmax(dim=-1) == flat_targets) & kept).sum())

    return BatchLoss(total, kept.sum(dtype=torch.float64), correct)


def cross_entropy(model: torch.nn.Module, batch: Any, ignore_index: int = IGNORE_INDEX) -> BatchLoss:
    """Token-level cross-entropy: logits ``[batch, ..., classes]`` against class ids
    ``[batch, ...]``, summed over every position whose target is not ``ignore_index``, weighed
    by how many there are (one per sample for a classifier)."""
    inputs, targets = split_batch(batch, "cross_entropy")
    return _token_cross_entropy(logits_of(model, inputs), targets, ignore_index)


def causal_lm(model: torch.nn.Module, batch: Any, ignore_index: int = IGNORE_INDEX) -> BatchLoss:
    """Next-token loss of a causal LM: the logits at position t predict token t+1. The batch
    is token ids ``[batch, time]``, or a dict with ``input_ids`` (and optionally ``labels``,
    else the ids with ``attention_mask == 0`` positions ignored) whose other entries are
    passed to the model."""
    if isinstance(batch, (tuple, list)) and len(batch) == 1:
        batch = batch[0]  # a TensorDataset of token ids
    if isinstance(batch, torch.Tensor):
        inputs: Any = batch
        labels = batch
    elif isinstance(batch, Mapping) and "input_ids" in batch:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        labels = batch.get("labels")
        if labels is None:
            labels = batch["input_ids"]
            if "attention_mask" in batch:
                labels = labels.masked_fill(batch["attention_mask"] == 0, ignore_index)
    else:
        raise ValueError(f"loss 'causal_lm': expected token ids [batch, time] or a dict with 'input_ids', got {_describe(batch)}")
    logits = logits_of(model, inputs)
    return _token_cross_entropy(logits[:, :-1], labels[:, 1:], ignore_index)


def mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Per-sample squared error, averaged over each sample's positions."""
    inputs, targets = split_batch(batch, "mse")
    output = logits_of(model, inputs)
    losses = F.mse_loss(output.float(), targets.to(torch.float32), reduction="none")
    return losses.reshape(output.shape[0], -1).mean(dim=1)


BUILTINS: dict[str, Callable[..., Any]] = {"cross_entropy": cross_entropy, "causal_lm": causal_lm, "mse": mse}


class Objective:
    """The job's loss (``LossConfig``): a built-in name, an import path or a callable, with
    keyword arguments. Calling it validates what the loss returned; a bad return raises
    ValueError naming ``loss`` and what was expected."""

    def __init__(self, loss: str | Callable[..., Any], kwargs: dict[str, Any] | None = None) -> None:
        if isinstance(loss, str) and loss in BUILTINS:
            self.fn, self.name = BUILTINS[loss], loss
        else:
            self.fn = factories.as_callable(loss)
            self.name = loss if isinstance(loss, str) else getattr(loss, "__qualname__", repr(loss))
        self.kwargs = dict(kwargs or {})

    def __call__(self, model: torch.nn.Module, batch: Any, num_samples: int) -> BatchLoss:
        """The loss of ``batch`` (``num_samples`` samples) under ``model``."""
        return self.check(self.fn(model, batch, **self.kwargs), num_samples)

    def check(self, result: Any, num_samples: int) -> BatchLoss:
        """``result`` as a BatchLoss; raises ValueError if it is neither per-sample losses of
        ``num_samples`` entries nor a ``(loss_sum, weight)`` pair with a finite weight >= 0."""
        if isinstance(result, BatchLoss):
            return result
        if isinstance(result, torch.Tensor):
            if result.dim() == 1 and result.shape[0] == num_samples:
                return BatchLoss(result.sum(), float(num_samples))
            if result.dim() == 0:
                raise ScalarLossError(
                    f"field 'loss' ({self.name}) returned a scalar, the batch's mean or sum: return per-sample losses "
                    f"of shape [{num_samples}] (e.g. reduction='none'), or the pair (loss_sum, weight), e.g. "
                    "(F.cross_entropy(logits, targets, reduction='sum'), len(targets))"
                )
            raise ValueError(
                f"field 'loss' ({self.name}) returned a tensor of shape {tuple(result.shape)}: expected "
                f"per-sample losses of shape [{num_samples}] or a (loss_sum, weight) pair"
            )
        if isinstance(result, (tuple, list)) and len(result) == 2:
            total, weight = result
            if not isinstance(total, torch.Tensor) or total.numel() != 1:
                raise ValueError(
                    f"field 'loss' ({self.name}) returned loss_sum {_describe(total)}: expected a scalar tensor"
                )
            value = float(weight)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"field 'loss' ({self.name}) returned weight {value}: expected a finite number >= 0")
            return BatchLoss(total.reshape(()), value)
        raise ValueError(
            f"field 'loss' ({self.name}) returned {_describe(result)}: expected per-sample losses of "
            f"shape [{num_samples}] or a (loss_sum, weight) pair"
        )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(map(str, value))}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__
