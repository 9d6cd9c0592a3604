"""``build_model`` (``workers/model/build.py``): the job's model built for a worker, in training
mode, its parameters views into one flat buffer on the device, compiled where the job asks;
half-precision parameters refused naming ``model.factory``."""

from __future__ import annotations

import pytest
import torch

from orchestrator.job.reading import load_job
from workers.model.build import build_model

CPU = torch.device("cpu")


def test_the_model_trains_on_its_flat_parameters():
    model, flat = build_model(load_job(None, ["eval=null"]), CPU)
    assert model.training
    parameters = [p for p in model.parameters() if p.requires_grad]
    assert flat.numel == sum(p.numel() for p in parameters)
    with torch.no_grad():
        flat.values.fill_(0.25)  # a write to the flat buffer is a write to the model
    assert all(bool((p == 0.25).all()) for p in parameters)


def test_half_precision_parameters_are_refused_naming_the_factory():
    job = load_job(None, ["eval=null", "model.factory=tests.helpers.losses:make_bf16_digits_model"])
    with pytest.raises(ValueError, match="field 'model.factory': the model's parameters are torch.bfloat16; keep them float32"):
        build_model(job, CPU)


def test_a_model_the_job_compiles_keeps_the_flat_buffers_parameters(monkeypatch):
    compiled: list[torch.nn.Module] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *args, **kwargs: compiled.append(self))
    job = load_job(None, ["eval=null"])
    job = job.model_copy(update={"model": job.model.model_copy(update={"compile": True})})
    model, flat = build_model(job, CPU)
    assert compiled == [model]  # in place: the same parameters (the flat buffer's views) and names
    assert next(model.parameters()).data_ptr() == flat.values.data_ptr()
