"""Evaluation: the model's mean loss and metrics over an eval dataset, without gradients."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from jobspec import targets as factories
from jobspec.stream import DataFeed
from workers.data.batches import fetch_batch, move_to
from workers.data.files import open_source
from workers.model.objective import Objective
from workers.model.precision import autocast

if TYPE_CHECKING:
    from jobspec.job import JobConfig


def evaluate_job(
    model: torch.nn.Module, job: JobConfig, objective: Objective, fed: DataFeed | None = None
) -> dict[str, float]:
    """``evaluate_model`` on the job's eval dataset, as its ``eval`` spec says (its collate, or
    the training dataset's; its metrics and batch; the job's precision; ``fed``: its files'
    index or its stream's feeder); {} without one."""
    spec = job.eval
    if spec is None:
        return {}
    return evaluate_model(
        model, open_source(spec, fed), objective, batch=spec.batch_size,
        collate=factories.optional_callable(spec.collate or job.dataset.collate),
        metrics=factories.optional_callable(spec.metrics), precision=job.precision,
    )


def evaluate_model(
    model: torch.nn.Module,
    dataset: Dataset,
    objective: Objective,
    *,
    batch: int = 256,
    collate: Callable[[list[Any]], Any] | None = None,
    metrics: Callable[..., Mapping[str, Any]] | None = None,
    precision: str = "fp32",
) -> dict[str, float]:
    """The objective's loss over ``dataset`` (its loss sum over its weight), accuracy (for
    the built-in classification losses: correct over weighed predictions) and the user's
    ``metrics`` sums divided by the number of samples; without gradients, leaving the model in
    the mode it found it. Raises ValueError if ``metrics`` returns something other than a dict
    of numbers."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_total, weight, correct = 0.0, 0.0, 0.0
    sums: dict[str, float] = {}
    has_accuracy = True
    with torch.no_grad():
        for lo in range(0, len(dataset), batch):
            indices = np.arange(lo, min(lo + batch, len(dataset)))
            data = move_to(fetch_batch(dataset, indices, collate), device)
            with autocast(device, precision):
                result = objective(model, data, len(indices))
                extra = metrics(model, data) if metrics is not None else {}
            loss_total += float(result.total)
            weight += float(result.weight)
            has_accuracy = has_accuracy and result.correct is not None
            correct += result.correct() if result.correct is not None else 0.0
            if not isinstance(extra, Mapping):
                raise ValueError(f"field 'eval.metrics' returned {type(extra).__name__}: expected a dict of numbers")
            for key, value in extra.items():
                sums[key] = sums.get(key, 0.0) + float(value)
    model.train(was_training)
    found = {"loss": loss_total / weight if weight else float("nan"), "samples": float(len(dataset))}
    if has_accuracy and weight:
        found["accuracy"] = correct / weight
    found.update({key: total / max(len(dataset), 1) for key, total in sums.items()})
    return found
