"""``workers.optim.named_tensors``: restoring a saved state into live tensors by name.
``check_fit`` accepts exactly the targets' names, each in its target's shape (in any order),
and otherwise raises ValueError with ``mismatch(held, needed)``: the loaded and the target
layouts, sorted names and shapes. ``copy_by_name`` copies into the live tensors in place, so
views into a flat buffer, and a model's parameters, see the saved values."""

from __future__ import annotations

import pytest
import torch

from workers.optim.named_tensors import check_fit, copy_by_name


def _mismatch(held: str, needed: str) -> str:
    return f"held {held} needed {needed}"


def _targets() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(2, 3), "b": torch.zeros(3)}


def test_the_same_names_and_shapes_in_another_order_fit() -> None:
    loaded = {"b": torch.ones(3, dtype=torch.float64), "w": torch.ones(2, 3)}
    assert check_fit(_targets(), loaded, _mismatch) is None


def test_a_missing_name_is_refused_with_both_layouts_sorted_by_name_held_first() -> None:
    targets = {"w": torch.zeros(2, 3), "b": torch.zeros(3), "a": torch.zeros(1)}
    loaded = {"w": torch.zeros(2, 3), "a": torch.zeros(1)}
    with pytest.raises(ValueError) as refused:
        check_fit(targets, loaded, _mismatch)
    assert str(refused.value) == "held [('a', (1,)), ('w', (2, 3))] needed [('a', (1,)), ('b', (3,)), ('w', (2, 3))]"


def test_a_name_the_targets_do_not_have_is_refused() -> None:
    loaded = {**_targets(), "stray": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"held \[\('b', \(3,\)\), \('stray', \(4,\)\), \('w', \(2, 3\)\)\]"):
        check_fit(_targets(), loaded, _mismatch)


def test_a_tensor_of_the_same_size_in_another_shape_is_refused() -> None:
    loaded = {"w": torch.zeros(3, 2), "b": torch.zeros(3)}
    with pytest.raises(ValueError) as refused:
        check_fit(_targets(), loaded, _mismatch)
    assert str(refused.value) == "held [('b', (3,)), ('w', (3, 2))] needed [('b', (3,)), ('w', (2, 3))]"


def test_copies_land_in_place_so_views_into_a_flat_buffer_see_them() -> None:
    flat = torch.zeros(9)
    targets = {"w": flat[:6].view(2, 3), "b": flat[6:]}
    loaded = {"w": torch.arange(6, dtype=torch.float64).view(2, 3), "b": torch.tensor([7.0, 8.0, 9.0])}
    check_fit(targets, loaded, _mismatch)
    copy_by_name(targets, loaded)
    assert torch.equal(flat, torch.tensor([0.0, 1, 2, 3, 4, 5, 7, 8, 9]))
    assert all(t.dtype == torch.float32 and t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
               for t in targets.values())  # still the buffer's views, in its dtype
    loaded["b"].zero_()
    assert torch.equal(flat[6:], torch.tensor([7.0, 8.0, 9.0]))  # copied, not shared


def test_a_models_parameters_take_the_saved_values_without_recording_the_copy() -> None:
    model = torch.nn.Linear(3, 2)
    params = dict(model.named_parameters())
    saved = {"weight": torch.full((2, 3), 0.5), "bias": torch.tensor([1.0, -1.0])}
    copy_by_name(params, saved)
    assert torch.equal(model.weight, saved["weight"]) and torch.equal(model.bias, saved["bias"])
    assert model.weight is params["weight"] and model.weight.requires_grad
    assert model.weight.grad_fn is None and model.bias.grad_fn is None  # still leaves: no autograd history
