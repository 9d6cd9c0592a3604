"""``StepPipeline.top_up`` alone, through its hooks (``BatchHooks``): what it asks about each
batch, in what order, where batches end, and when the next one is held back. Pure: a recording
group stands for the workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from jobspec.wire import SnapshotOrder
from orchestrator.group.interface import Call, Submitted
from orchestrator.steps.pipeline import StepPipeline
from policies.run_ahead import BATCHES_IN_FLIGHT, RunAhead
from policies.work_stealing import StepPlan


@dataclass
class Hooks:
    """Records every question; boundaries, held batches and checkpoints as set."""

    boundaries: set[int] = field(default_factory=set)
    holding: bool = False
    snapshot_at: int | None = None
    asked: list[tuple] = field(default_factory=list)

    def boundary(self, step: int) -> bool:
        return step in self.boundaries

    def hold(self, first: int, count: int) -> bool:
        self.asked.append(("hold", first, count))
        return self.holding

    def before_submit(self, step: int) -> None:
        self.asked.append(("before_submit", step))

    def plan(self, step: int) -> StepPlan:
        self.asked.append(("plan", step))
        return StepPlan(((0,),))

    def snapshot_inside(self, first: int, count: int) -> SnapshotOrder | None:
        self.asked.append(("snapshot_inside", first, count))
        if self.snapshot_at is not None and first < self.snapshot_at <= first + count:
            return SnapshotOrder(self.snapshot_at, "/ckpt", f"step-{self.snapshot_at:08d}", "a1", 1)
        return None


@dataclass
class RecordingGroup:
    workers: list[int] = field(default_factory=lambda: [0])
    batches: list[tuple[int, int, SnapshotOrder | None]] = field(default_factory=list)
    released: int = 0

    def submit_steps(self, first: int, plans: Sequence[StepPlan], snapshot: SnapshotOrder | None = None) -> Submitted:
        self.batches.append((first, len(plans), snapshot))
        return Submitted((Call(0, object()),))

    def release_followers(self) -> None:
        self.released += 1


def _pipeline(hooks: Hooks, size: int = 4) -> tuple[StepPipeline, RecordingGroup]:
    group = RecordingGroup()
    return StepPipeline(group, 0, RunAhead(max_steps=8, size=size), hooks), group  # type: ignore[arg-type]


def test_each_batch_is_planned_step_by_step_after_its_boundary_act_and_asks_for_its_checkpoint():
    hooks = Hooks(snapshot_at=3)
    pipeline, group = _pipeline(hooks)
    pipeline.top_up(num_steps=20)
    assert len(pipeline.in_flight) == BATCHES_IN_FLIGHT == 2
    assert [(first, count) for first, count, _ in group.batches] == [(0, 4), (4, 4)]
    assert group.batches[0][2] == SnapshotOrder(3, "/ckpt", "step-00000003", "a1", 1) and group.batches[1][2] is None
    assert hooks.asked == [
        ("before_submit", 0), ("plan", 0), ("plan", 1), ("plan", 2), ("plan", 3), ("snapshot_inside", 0, 4),
        ("hold", 4, 4), ("before_submit", 4), ("plan", 4), ("plan", 5), ("plan", 6), ("plan", 7), ("snapshot_inside", 4, 4),
    ]
    assert group.released == 0  # two batches queued: the followers wait for the next


def test_a_batch_ends_in_front_of_a_boundary_and_at_the_last_step():
    pipeline, group = _pipeline(Hooks(boundaries={2}))
    pipeline.top_up(num_steps=3)
    assert [(first, count) for first, count, _ in group.batches] == [(0, 2), (2, 1)]
    assert pipeline.next_step == 3


def test_a_held_batch_waits_and_the_followers_are_released():
    hooks = Hooks(holding=True)
    pipeline, group = _pipeline(hooks)
    pipeline.top_up(num_steps=20)
    assert [(first, count) for first, count, _ in group.batches] == [(0, 4)]
    assert ("hold", 4, 4) in hooks.asked and ("before_submit", 4) not in hooks.asked
    assert group.released == 1
    pipeline.drain()
    hooks.holding = False
    pipeline.top_up(num_steps=20)
    assert [(first, count) for first, count, _ in group.batches][1:] == [(4, 4), (8, 4)]
