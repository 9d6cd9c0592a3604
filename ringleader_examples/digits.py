"""Handwritten digits (scikit-learn's bundled 8x8 images, 1797 samples) and an MLP for them."""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import TensorDataset

TEST_FRACTION = 0.2


@lru_cache(maxsize=1)
def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled ``digits.csv.gz``, read without importing scikit-learn.

    Same arrays as ``sklearn.datasets.load_digits(return_X_y=True)``; importing sklearn costs
    ~2 s per worker process, reading the file ~30 ms.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the digits example needs scikit-learn installed (pip install scikit-learn)")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def make_dataset(split: Literal["train", "test"] = "train") -> TensorDataset:
    """A fixed 80/20 split (the same on every worker): inputs ``[n, 64]`` in [0, 1], labels 0-9."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    images, labels = _load_digits()
    order = np.random.default_rng(0).permutation(len(labels))
    cut = int(len(labels) * (1 - TEST_FRACTION))
    chosen = order[:cut] if split == "train" else order[cut:]
    inputs = torch.from_numpy(images[chosen].astype(np.float32) / 16.0)
    return TensorDataset(inputs, torch.from_numpy(labels[chosen].astype(np.int64)))


def make_model(hidden: int = 128, depth: int = 2) -> torch.nn.Module:
    """An MLP 64 -> hidden (x depth) -> 10 with ReLU."""
    layers: list[torch.nn.Module] = []
    width = 64
    for _ in range(depth):
        layers += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)
