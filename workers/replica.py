"""What a model replica holds, as the code that moves its whole training state sees it: joining a
group (taking rank 0's state, ``workers/group_link.py``) and checkpoints (snapshot and restore,
``workers/replica_checkpoint.py``). The worker actor (``TrainWorker``) is one.
"""

from __future__ import annotations

from typing import Protocol

import torch

from workers.model.flat_parameters import FlatParameters
from workers.optim.fused import FlatOptimizer
from workers.optim.generic import GenericOptimizer
from workers.optim.loss_scaler import LossScaler
from workers.sharding.optimizer import ShardedOptimizer
from workers.state_layout import StateLayout


class Replica(Protocol):
    """A replica's training state: the model (its parameters views into ``flat``), the
    optimizer, how the state lies over the group (``state``: whole, or this rank's slice), the
    fp16 loss scaler, the device they live on, and ``next_step``, the next step the replica
    will apply (-1 while it holds no whole state: a transfer under way)."""

    model: torch.nn.Module
    flat: FlatParameters
    optimizer: FlatOptimizer | GenericOptimizer | ShardedOptimizer
    state: StateLayout
    scaler: LossScaler
    device: torch.device
    next_step: int
