"""A job's recipe as a plain single-device PyTorch loop: the contender ringleader's worker is
held to (``bench gpu``, ``bench overhead``). The same model, windows, AdamW (fused, the same
decay groups), clipping and autocast; no host sync in a step: the host queues step after step
and runs ahead of the device, as such a loop does."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class PlainLoop:
    """``job`` (a GPT-recipe ``JobConfig``: causal LM loss, AdamW) on ``device``; its model
    compiled where ``model.compile`` says so, as the worker's is."""

    def __init__(self, job: Any, device: torch.device) -> None:
        from jobspec.targets import build
        from workers.data.sampler import ShardSampler
        from workers.optim.generic import decay_groups

        torch.manual_seed(job.seed)
        self.job, self.device = job, device
        self.model = build(job.model.factory, job.model.kwargs).to(device)
        if job.model.compile:
            self.model.compile()  # as the worker does (``model.compile``)
        groups = [g for g in decay_groups(self.model.parameters(), job.optimizer.decay_biases_and_norms) if g["params"]]
        self.optimizer = torch.optim.AdamW(groups, **job.optimizer.kwargs, fused=True)
        self.dataset = build(job.dataset.factory, job.dataset.kwargs)
        self.sampler = ShardSampler(len(self.dataset), job.batch_size, job.shards, job.seed, shuffle=job.dataset.shuffle)

    def step(self, index: int) -> None:
        """Train step ``index`` (its windows: every shard's, as the sampler deals them)."""
        from workers.data.batches import fetch_batch
        from workers.model.precision import autocast

        job = self.job
        indices = [int(i) for shard in range(job.shards) for i in self.sampler.shard_indices(index, shard)]
        ids = fetch_batch(self.dataset, indices).to(self.device, non_blocking=True)
        with autocast(self.device, job.precision):
            logits = self.model(ids)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), job.optimizer.clip_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
