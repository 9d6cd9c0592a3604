"""Losses, batches, gradient finishing, loss scaling and optimizers of a bring-your-own job,
without Ray: the contract of workers/model/objective.py and what the worker does after the reduce."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers.gradients import finish_gradient
from tests.helpers.losses import IGNORE, make_model, make_sequences, pad_collate, token_loss
from workers.data.batches import fetch_batch, move_to
from workers.model.evaluate import evaluate_model
from workers.model.flat_parameters import FlatParameters
from workers.model.objective import Objective
from workers.optim.fused import FlatOptimizer
from workers.optim.generic import GenericOptimizer, decay_groups
from workers.optim.loss_scaler import LossScaler


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_a_token_mean_split_into_padded_shards_is_the_global_token_mean():
    """Shards with different token counts: summing each shard's loss-sum gradient and dividing
    by the summed weight is the per-token mean over the whole batch, padding excluded."""
    items = make_sequences(12)
    torch.manual_seed(0)
    model = make_model()
    objective = Objective(token_loss)
    whole = objective(model, pad_collate(items), 12)
    (whole.total / whole.weight).backward()
    expected = _grads(model).clone()
    model.zero_grad()
    weight = 0.0
    for lo, hi in ((0, 2), (2, 9), (9, 12)):  # uneven shards, each padded to its own longest
        part = objective(model, pad_collate(items[lo:hi]), hi - lo)
        part.total.backward()
        weight += part.weight
    assert weight == whole.weight == sum(len(item["input_ids"]) for item in items)
    torch.testing.assert_close(_grads(model) / weight, expected)


def test_builtin_cross_entropy_is_token_level_and_ignores_ignore_index():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 6)
    targets = torch.randint(0, 6, (2, 4))
    targets[1, 2:] = IGNORE
    loss = Objective("cross_entropy")(lambda x: logits, (None, targets), 2)
    assert loss.weight == 6
    torch.testing.assert_close(loss.total, F.cross_entropy(logits.reshape(-1, 6), targets.reshape(-1), reduction="sum"))
    assert loss.correct is not None and loss.correct() == float(((logits.argmax(-1) == targets) & (targets != IGNORE)).sum())


def test_causal_lm_shifts_and_masks_padding():
    torch.manual_seed(0)
    ids = torch.randint(0, 9, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    logits = torch.randn(2, 5, 9)
    seen = {}

    def model(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        seen["mask"] = attention_mask
        return logits

    loss = Objective("causal_lm")(model, {"input_ids": ids, "attention_mask": mask}, 2)
    assert seen["mask"] is mask and loss.weight == 4 + 2  # predicting tokens 1..4 and 1..2
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 9), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    torch.testing.assert_close(loss.total, expected)
    plain = Objective("causal_lm")(lambda x: logits, ids, 2)
    assert plain.weight == 8
    assert Objective("causal_lm")(lambda x: logits, (ids,), 2).weight == 8  # a TensorDataset's batch


def test_mse_is_per_sample_and_weighs_samples():
    loss = Objective("mse")(lambda x: torch.ones(3, 2), (None, torch.zeros(3, 2)), 3)
    assert loss.weight == 3 and float(loss.total) == 3.0


@pytest.mark.parametrize(
    "returned, expected",
    [
        (torch.ones(2), "returned a tensor of shape (2,): expected per-sample losses of shape [3]"),
        ((torch.ones(2), 1.0), "returned loss_sum a tensor of shape (2,): expected a scalar tensor"),
        ((torch.tensor(1.0), float("nan")), "returned weight nan: expected a finite number >= 0"),
        ((torch.tensor(1.0), -1), "returned weight -1.0"),
        ({"loss": 1}, "returned a dict with keys ['loss']"),
    ],
)
def test_a_bad_loss_return_names_the_field(returned, expected):
    def bad(model: object, batch: object) -> object:
        return returned

    with pytest.raises(ValueError, match=r"field 'loss' \(.*bad\)") as err:
        Objective(bad)(None, None, 3)
    assert expected in str(err.value)


def test_dict_items_are_collated_and_moved_whole():
    items = make_sequences(5)
    batch = fetch_batch(items, np.array([4, 1]), pad_collate)
    assert batch["input_ids"].shape[0] == 2 and (batch["labels"] == IGNORE).any() == (
        len(items[4]["input_ids"]) != len(items[1]["input_ids"])
    )
    moved = move_to(batch, torch.device("cpu"))
    assert moved.keys() == batch.keys()
    plain = fetch_batch([{"x": torch.tensor([float(i)])} for i in range(3)], np.array([2, 0]))
    assert plain["x"].tolist() == [[2.0], [0.0]]


def test_finish_gradient_divides_by_the_weight_then_clips_to_the_global_norm():
    grads = torch.tensor([3.0, 4.0]) * 8  # reduced sum, scaled by 1/2 (e.g. loss scale / batch)
    update = finish_gradient(grads, weight=4.0, scaled_by=0.5 * 2, clip=None)
    assert update.grad_norm == pytest.approx(10.0) and not update.clipped
    torch.testing.assert_close(grads, torch.tensor([6.0, 8.0]))
    update = finish_gradient(grads, weight=1.0, scaled_by=1.0, clip=1.0)
    assert update.clipped and update.grad_norm == pytest.approx(10.0)
    assert float(grads.norm()) == pytest.approx(1.0, rel=1e-5)
    overflowed = torch.tensor([1.0, math.inf])
    assert not math.isfinite(finish_gradient(overflowed, 1.0, 1.0, 1.0).grad_norm)
    with pytest.raises(ValueError, match="field 'loss': the step's loss weights sum to 0"):
        finish_gradient(torch.ones(2), 0.0, 1.0, None)


def test_the_loss_scaler_skips_overflows_backs_off_and_grows():
    scaler = LossScaler(True, init=8.0, growth=2.0, backoff=0.5, growth_interval=2)
    assert scaler.update(math.inf) and scaler.scale == 4.0
    assert not scaler.update(1.0) and scaler.scale == 4.0
    assert not scaler.update(1.0) and scaler.scale == 8.0
    copy = LossScaler(True, init=1.0)
    copy.state.copy_(scaler.state)
    copy.state_restored()
    assert copy.scale == 8.0
    off = LossScaler(False)
    assert not off.update(math.nan) and off.scale == 1.0


@pytest.mark.parametrize("name, kwargs", [("adamw", {"lr": 0.01, "weight_decay": 0.1}), ("adam", {"lr": 0.01, "weight_decay": 0.1}), ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1})])
def test_fused_optimizer_without_decay_on_biases_and_norms_matches_torch_param_groups(name, kwargs):
    stock_cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name]
    torch.manual_seed(0)
    stock_model = make_model(8)
    torch.manual_seed(0)
    model = make_model(8)
    flat = FlatParameters(model.parameters())
    ours = FlatOptimizer(name, kwargs, flat.values, flat.grads, flat.no_decay_ranges())
    stock = stock_cls(decay_groups(stock_model.parameters(), False), **kwargs)
    batch = pad_collate(make_sequences(6))
    for _ in range(3):
        for m in (model, stock_model):
            m.zero_grad() if m is stock_model else flat.zero()
            token_loss(m, batch)[0].backward()
        ours.step()
        stock.step()
    for got, want in zip(model.parameters(), stock_model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    decayed_everywhere = FlatOptimizer(name, kwargs, flat.values.clone(), flat.grads.clone())
    assert not decayed_everywhere._decayed and ours._decayed  # the option changes something


def test_a_generic_optimizer_state_travels_through_broadcast_and_checkpoint():
    torch.manual_seed(0)
    source_model, target_model = make_model(8), make_model(8)
    source = GenericOptimizer("RAdam", {"lr": 0.01, "weight_decay": 0.1}, list(source_model.parameters()), False)
    target = GenericOptimizer("RAdam", {"lr": 0.01, "weight_decay": 0.1}, list(target_model.parameters()), False)
    assert [g["weight_decay"] for g in source.optimizer.param_groups] == [0.1, 0.0]
    token_loss(source_model, pad_collate(make_sequences(4)))[0].backward()
    source.step(lr=0.02)
    sent = []
    source.sync(sent.append, is_root=True)  # what the root broadcasts
    replies = iter(sent)
    target.sync(lambda tensor: tensor.copy_(next(replies)), is_root=False)  # a joiner receives it
    assert target.optimizer.state_dict()["state"].keys() == source.optimizer.state_dict()["state"].keys()
    for key, value in source.optimizer.state_dict()["state"][0].items():
        torch.testing.assert_close(target.optimizer.state_dict()["state"][0][key], value)
    flat, whole = source.checkpoint_tensors()
    fresh = GenericOptimizer("RAdam", {"lr": 0.01}, list(make_model(8).parameters()), False)
    fresh.restore(flat, whole)
    assert fresh.optimizer.state_dict()["state"].keys() == source.optimizer.state_dict()["state"].keys()
    with pytest.raises(ValueError, match="is not a RAdam's"):
        fresh.restore({"exp_avg": torch.zeros(3)}, {})


def test_eval_reports_token_loss_accuracy_and_user_metrics():
    from tests.helpers.losses import token_accuracy

    torch.manual_seed(0)
    model = make_model(8)
    items = make_sequences(10)
    found = evaluate_model(model, items, Objective(token_loss), batch=4, collate=pad_collate, metrics=token_accuracy)
    whole = token_loss(model, pad_collate(items))
    assert found["loss"] == pytest.approx(float(whole[0].detach()) / float(whole[1]), rel=1e-5)
    assert 0.0 <= found["token_accuracy"] <= 1.0 and found["samples"] == 10 and "accuracy" not in found
    with pytest.raises(ValueError, match="field 'eval.metrics' returned list"):
        evaluate_model(model, items, Objective(token_loss), collate=pad_collate, metrics=lambda m, b: [1.0])
