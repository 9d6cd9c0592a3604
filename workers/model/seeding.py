"""The seeds of a step's randomness inside the forward pass (dropout and the like): a function of
the job's seed, the step and the shard (and the piece of a split pass), never of the worker
that runs it, so any assignment of shards draws the same numbers."""

from __future__ import annotations

import torch


def shard_seed(seed: int, step: int, shard: int) -> int:
    # Randomness inside the forward pass (dropout) depends on the shard, not on the worker.
    return ((seed * 1_000_003 + step) * 1_000_003 + shard) & 0x7FFF_FFFF_FFFF_FFFF


def piece_seed(seed: int, piece: int) -> int:
    # Piece 0 keeps the shard's seed; later pieces mix their number in, so piece k of shard s
    # never shares shard s+k's seed (shard_seed is linear in the shard).
    return seed if piece == 0 else ((seed * 1_000_003 + piece) * 1_000_003) & 0x7FFF_FFFF_FFFF_FFFF


def seed_forward(seed: int, device: torch.device) -> None:
    """Seed the generator a forward pass on ``device`` draws from (dropout and the like).
    Not ``torch.manual_seed``: it seeds every device type, and where CUDA is not initialised
    it formats a stack trace on every call to queue CUDA's seeding (~0.4 ms a pass here)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
