"""Sharded optimizer state keeps the trajectory: real workers (``TrainWorker``, no Ray) in
spawned processes over gloo train a few steps with the optimizer state sharded in groups of 2
and 3, with 1 and 2 replicas, for sgd with momentum and adamw with clipping and decay groups,
a generic optimizer (RAdam with decay groups, reduced after backward), adam in fp16 whose first
steps overflow, and adamw in several passes a step, in fp32, bf16 and fp16, and end with the
parameters (and skip the steps) the unsharded workers do."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.jobs import Reference, Yardstick, assert_control_differs, assert_same_params, distance
from tests.helpers.ranks import run_ranks

STEPS = 5
SHARDS = 12


def _train(rank: int, world: int, port: int, results: dict, runs: list[tuple[str, list[str]]]) -> None:
    """Each of ``runs`` (a name, its overrides) trained from scratch in a group of its own."""
    from jobspec.wire import JoinRequest
    from orchestrator.job.reading import load_job
    from policies.split import even_bounds
    from policies.work_stealing import StepPlan
    from tests.helpers.ranks import tcp_store
    from workers.actor import TrainWorker

    store = tcp_store(rank, world, port)  # rank 0 hosts it, as the driver does
    blocks = tuple(tuple(range(lo, hi)) for lo, hi in even_bounds(SHARDS, world))
    for generation, (name, overrides) in enumerate(runs, start=1):
        job = load_job(None, [
            f"steps={STEPS}", "eval=null", f"shards={SHARDS}", "batch_size=96", f"scaling.workers={world}",
            "collective.algorithm=ring", *overrides,
        ])
        worker = TrainWorker(job, worker_id=rank)
        worker.join_group(JoinRequest("127.0.0.1", port, f"gen{generation}/", generation, rank, ("node",) * world, 30.0))
        reports = [worker.train_step(step, StepPlan(blocks, steal=False, speculate=False)) for step in range(STEPS)]
        state = _state_entries(worker.optimizer)
        results[name, rank] = (worker.flat.values.clone(), [r.grad_norm for r in reports], state, [r.skipped for r in reports])
        worker.leave_group()
    del store  # rank 0 hosted the store until every rank was done with it


def _state_entries(optimizer: object) -> int:
    """Entries of the optimizer's state that are one value per parameter entry (moments, not
    step counts): what sharding divides."""
    from workers.optim.generic import GenericOptimizer

    if isinstance(optimizer, GenericOptimizer):
        found = [
            v for p, state in optimizer.optimizer.state.items() for v in state.values()
            if isinstance(v, torch.Tensor) and v.shape == p.shape
        ]
    else:
        found = [v for v in optimizer.state_tensors().values() if v.dim() == 1]
    return sum(v.numel() for v in found)


RECIPES = {
    "sgd-fp32": ["optimizer.name=sgd", "optimizer.kwargs={lr: 0.1, momentum: 0.9}"],
    # A generic torch.optim optimizer: the slice stepped as 1-D pieces of the parameters.
    # Reduced after backward (no overlap): every bucket taken out of the parameters at once.
    "radam-fp32": [
        "optimizer.name=RAdam", "optimizer.kwargs={lr: 0.01, weight_decay: 0.01}", "optimizer.decay_biases_and_norms=false",
        "collective.overlap=false",
    ],
    # Several passes a step: the parameters' own gradients accumulate until the last backward.
    "adamw-passes": ["optimizer.name=adamw", "optimizer.kwargs={lr: 0.01}", "worker.max_samples_per_pass=5"],
    # fp16 with a loss scale that overflows at first: the steps it skips must be the same.
    "adam-fp16": ["optimizer.name=adam", "optimizer.kwargs={lr: 0.01}", "precision=fp16", "loss_scaling.init=1e12", "loss_scaling.backoff=1e-4"],
    "adamw-bf16": [
        "optimizer.name=adamw", "optimizer.kwargs={lr: 0.01, weight_decay: 0.1}", "optimizer.clip_grad_norm=0.05",
        "optimizer.decay_biases_and_norms=false", "precision=bf16",
    ],
}


@pytest.mark.parametrize(("world", "group_sizes"), [(4, (2, 4)), (3, (3,))], ids=["4-ranks", "3-ranks"])
def test_sharded_training_follows_the_unsharded_trajectory(world, group_sizes):
    """Against unsharded workers of the same count: the same passes (bf16 forwards depend on
    how a rank's shards are fused), only the sums' order and who steps what differ. Groups of
    2 on 4 ranks keep 2 replicas; of 4 and of 3, one."""
    runs = [
        (f"{recipe}-g{g}", [*overrides, f"sharding.group_size={g}"] if g > 1 else overrides)
        for recipe, overrides in sorted(RECIPES.items()) for g in (1, *group_sizes)
    ]
    # Each recipe's yardstick: the farther of two unsharded runs in another float order, the
    # gradient summed by gloo's own all-reduce instead of our ring, and one pass a shard. In half
    # precision the first sums alike (gradients of 8-11 significant bits add exactly in fp32),
    # and the last bit of a parameter can flip a rounding of the forward: the second measures that.
    reorderings = {"native": "collective.algorithm=native", "unfused": "worker.fuse_shards=false"}
    runs += [
        (f"{recipe}-{name}", [*overrides, override])
        for recipe, overrides in RECIPES.items() for name, override in reorderings.items()
    ]
    runs.append(("sgd-fp32-seed1", [*RECIPES["sgd-fp32"], "seed=1"]))  # the control: another trajectory
    results = run_ranks(_train, world, runs)
    for recipe in RECIPES:
        whole, whole_norms, whole_state, whole_skipped = results[f"{recipe}-g1", 0]
        found = {name: distance({"values": results[f"{recipe}-{name}", 0][0]}, {"values": whole}) for name in reorderings}
        farthest = max(found, key=found.__getitem__)
        ruler = Yardstick(found[farthest], f"unsharded, {reorderings[farthest]}")
        want = Reference({"values": whole}, ruler)
        if recipe == "sgd-fp32":
            assert_control_differs({"values": results["sgd-fp32-seed1", 0][0]}, want, "sgd with another seed")
        if recipe == "adamw-bf16":
            assert max(whole_norms) > 0.05  # the clipping is exercised
        if recipe == "adam-fp16":
            assert whole_skipped[0] and not all(whole_skipped)  # some steps overflow, some do not
        for g in group_sizes:
            for rank in range(world):
                values, norms, state, skipped = results[f"{recipe}-g{g}", rank]
                assert_same_params({"values": values}, want, f"{recipe} sharded in groups of {g}, rank {rank}")
                assert skipped == whole_skipped
                assert norms == pytest.approx(whole_norms, rel=max(1e-5, ruler.bound), nan_ok=True)
                # The rank holds its slice's state: a g-th of the whole (slices differ by an entry).
                assert whole_state > 0 and abs(state - whole_state / g) <= whole_state / whole.numel()
            sharded = [results[f"{recipe}-g{g}", rank][0] for rank in range(world)]
            assert all(torch.equal(values, sharded[0]) for values in sharded)  # replicas alike, bit for bit
