"""``model.compile``: the worker compiles its model in place (``nn.Module.compile``), and the
compiled model trains through the worker's hooks, buckets and flat buffers to where eager mode
does, within the yardstick of the same job summed in another order (one worker with
``fuse_shards: false``); another seed, the control, lands far outside. Compiling leaves a
checkpoint's trajectory config as it was: either resumes the other."""

from __future__ import annotations

import torch

from benchmarks.overhead import solo_worker
from benchmarks.workloads import EXAMPLES
from orchestrator.checkpoints.resume_point import config_hash
from orchestrator.job.reading import load_job
from tests.helpers.jobs import CONTROL_MARGIN, YARDSTICK_MULTIPLE, distance

TINY_GPT = [
    'model.kwargs={"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}',
    "dataset.kwargs={split: train, block_size: 32}", "eval=null", "batch_size=8", "shards=4", "steps=3",
    "precision=fp32", "checkpoint.every_steps=0", "collective.algorithm=native",
    "scaling={workers: 1, min_workers: 1, max_workers: 1}",
]


def _trained(*overrides: str) -> dict[str, torch.Tensor]:
    job = load_job(EXAMPLES / "gpt.yaml", [*TINY_GPT, *overrides])
    with solo_worker(job, torch.device("cpu")) as (worker, plan):
        for step in range(job.steps):
            worker.train_step(step, plan)
        assert hasattr(worker.model, "_compiled_call_impl") and (worker.model._compiled_call_impl is not None) == job.model.compile
        return worker.model_state()


def test_a_compiled_model_trains_where_eager_mode_does():
    eager = _trained()
    yardstick = distance(_trained("worker.fuse_shards=false"), eager)
    assert yardstick > 0
    compiled = distance(_trained("model.compile=true"), eager)
    assert compiled <= YARDSTICK_MULTIPLE * yardstick, f"compiled: {compiled:.3g}, yardstick {yardstick:.3g}"
    control = distance(_trained("seed=1"), eager)
    assert control > CONTROL_MARGIN * YARDSTICK_MULTIPLE * yardstick, f"another seed: {control:.3g}"


def test_compiling_leaves_the_trajectory_config_as_it_was():
    job = load_job(EXAMPLES / "gpt.yaml", TINY_GPT)
    assert config_hash(job) == config_hash(job.model_copy(update={"model": job.model.model_copy(update={"compile": True})}))
