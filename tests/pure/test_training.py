"""Worker-side math without Ray: flat gradients and batches."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from workers.data.batches import fetch_batch
from workers.model.flat_parameters import FlatParameters


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def test_flat_gradients_accumulate_in_place_across_backwards():
    model = _model()
    flat = FlatParameters(model.parameters(), extra=2)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    F.cross_entropy(model(x[:3]), y[:3], reduction="sum").backward()
    F.cross_entropy(model(x[3:]), y[3:], reduction="sum").backward()
    shard_sum = flat.buffer[2:].clone()  # layout: [extra | params]

    reference = _model()
    F.cross_entropy(reference(x), y, reduction="sum").backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(shard_sum, expected)
    assert flat.extra.shape == (2,) and torch.all(flat.extra == 0)

    flat.zero()
    assert torch.all(flat.buffer == 0)
    assert all(torch.all(p.grad == 0) for p in model.parameters())


def test_flat_parameters_are_views_of_values_in_order():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    flat = FlatParameters(model.parameters())
    torch.testing.assert_close(flat.values, torch.cat([b.reshape(-1) for b in before]))
    flat.values.add_(1.0)
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), b + 1.0)


def test_flat_gradients_detect_replaced_grads():
    model = _model()
    flat = FlatParameters(model.parameters())
    for p in model.parameters():
        p.grad = None  # what optimizer.zero_grad(set_to_none=True) would do
    with pytest.raises(RuntimeError, match="no longer views"):
        flat.zero()


def test_a_kept_gradient_slice_holds_only_its_entries_and_the_parameters_keep_their_own():
    model = _model()
    flat = FlatParameters(model.parameters(), extra=2)
    numel = flat.numel
    flat.keep_gradient_slice(10, 30)
    assert flat.buffer.numel() == 2 + 20 and flat.sliced  # the whole gradient is not kept
    assert all(p.grad is None for p in model.parameters())
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    F.cross_entropy(model(x[:3]), y[:3], reduction="sum").backward()
    copy = flat.accumulated()  # what a backup pass snapshots
    F.cross_entropy(model(x[3:]), y[3:], reduction="sum").backward()
    flat.restore_accumulated(copy)  # the backup lost: its pass taken back out
    reference = _model()
    F.cross_entropy(reference(x[:3]), y[:3], reduction="sum").backward()
    first = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    sizes = [p.numel() for p in model.parameters()]  # 35, 7, 21, 3
    taken = flat.take_gradients([1, 0])  # the first two parameters, any order given
    torch.testing.assert_close(taken, first[: sizes[0] + sizes[1]])
    assert model[0].weight.grad is None and model[0].bias.grad is None and model[2].weight.grad is not None
    model[2].bias.grad = None  # a parameter backward did not reach counts as zeros
    torch.testing.assert_close(flat.take_gradients([2, 3])[sizes[2]:], torch.zeros(sizes[3]))
    flat.grad_slice(10, 30).fill_(1.0)
    assert torch.all(flat.grads == 1.0) and flat.grad_slice(12, 14).numel() == 2
    with pytest.raises(ValueError, match=r"not held here \(only \[10, 30\]\)"):
        flat.grad_slice(5, 12)
    with pytest.raises(ValueError, match="outside"):
        flat.keep_gradient_slice(0, numel + 1)
    model[0].weight.grad = torch.ones_like(model[0].weight)  # left by an aborted step
    flat.keep_gradient_slice(10, 30)  # the same slice (a re-join after an aborted step): its leftovers freed
    assert all(p.grad is None for p in model.parameters())
    flat.zero()
    assert torch.all(flat.buffer == 0)


def test_a_sparse_gradient_is_taken_dense():
    embedding = torch.nn.Embedding(6, 3, sparse=True)
    flat = FlatParameters(embedding.parameters())
    flat.keep_gradient_slice(0, flat.numel)
    embedding(torch.tensor([1, 1, 4])).sum().backward()
    assert embedding.weight.grad.is_sparse
    want = torch.zeros(6, 3)
    want[1], want[4] = 2.0, 1.0
    torch.testing.assert_close(flat.take_gradients([0]), want.reshape(-1))


def test_fetch_batch_tensor_dataset_and_generic():
    data = TensorDataset(torch.arange(10.0), torch.arange(10) * 2)
    x, y = fetch_batch(data, np.array([3, 1]))
    assert x.tolist() == [3.0, 1.0] and y.tolist() == [6, 2]
    generic = [(torch.tensor([float(i)]), i) for i in range(5)]
    gx, gy = fetch_batch(generic, np.array([4, 0]))
    assert gx.tolist() == [[4.0], [0.0]] and gy.tolist() == [4, 0]


def test_digits_example_reads_sklearns_bundled_data_exactly():
    from sklearn.datasets import load_digits

    from ringleader_examples.digits import _load_digits

    images, labels = _load_digits()
    expected_images, expected_labels = load_digits(return_X_y=True)
    np.testing.assert_array_equal(images, expected_images)
    np.testing.assert_array_equal(labels, expected_labels)
