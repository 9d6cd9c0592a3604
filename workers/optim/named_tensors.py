"""Restoring a saved state into live tensors by name: the names and shapes must match, then each
saved tensor is copied into its live one in place (the live ones may be views into a flat
buffer, which a rebinding would cut loose). Used for the replica's parameters and buffers
(``workers/replica_checkpoint.py``) and the flat optimizer's state (``FlatOptimizer.restore``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


def _layout(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...]]]:
    """``tensors``' names and shapes, sorted by name: what a mismatch message shows."""
    return sorted((k, tuple(v.shape)) for k, v in tensors.items())


def check_fit(
    targets: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor], mismatch: Callable[[str, str], str]
) -> None:
    """Raise ValueError unless ``loaded`` holds exactly ``targets``' names, each in its target's
    shape; its message is ``mismatch(held, needed)``, the two layouts (sorted names and shapes) as text."""
    if loaded.keys() != targets.keys() or any(loaded[k].shape != t.shape for k, t in targets.items()):
        raise ValueError(mismatch(str(_layout(loaded)), str(_layout(targets))))


def copy_by_name(targets: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor]) -> None:
    """Copy each of ``loaded`` into the target of its name, in place (``check_fit`` first)."""
    with torch.no_grad():
        for key, target in targets.items():
            target.copy_(loaded[key])
