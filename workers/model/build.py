"""The job's model built for a worker: from its factory, onto the worker's device as flat parameters."""

from __future__ import annotations

import torch

from jobspec import targets as factories
from jobspec.job import JobConfig
from workers.model.flat_parameters import FlatParameters, flatten_onto


def build_model(job: JobConfig, device: torch.device) -> tuple[torch.nn.Module, FlatParameters]:
    """The job's model, in training mode (compiled if the job says so), its parameters moved onto
    ``device`` one by one into one flat buffer (never the whole model there beside them; the
    gradient waits for its extra slots, which the worker counts). Raises ValueError (naming
    ``model.factory``) for half-precision parameters: the census and loss weights ride in the
    parameters' dtype, and half types count exactly only to 256 (bf16) or 2048 (fp16)."""
    model: torch.nn.Module = factories.build(job.model.factory, job.model.kwargs)
    flat = flatten_onto(model, device)
    if flat.values.dtype in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"field 'model.factory': the model's parameters are {flat.values.dtype}; keep them float32 "
            "(the master weights) and set precision: bf16 or fp16 to compute in half precision"
        )
    model.train()
    if job.model.compile:
        model.compile()  # in place: the same parameters (the flat buffer's views) and names
    return model, flat
