"""Running short jobs in tests, reading what they leave behind, and judging whether two runs of
a job ended at the same parameters.

How close is the same: two runs of a job that differ only in who computed which shard sum the
same numbers in different float orders, so they end apart by float noise, and how much noise
depends on the job (its optimizer, learning rate and length turn rounding into drift) and on
the machine (which kernels ``ATEN_CPU_CAPABILITY`` picks). A fixed tolerance is right on one
machine and wrong on the next. So every invariance test measures its job's *yardstick*: how
far a clean one-worker run ends from the same run with each step's shards taken in a shuffled
order (``REORDERED``: the same sums, in another order, on this machine). A run passes if its
``distance`` (relative, over the whole state) from the one-worker run is at most
``YARDSTICK_MULTIPLE`` yardsticks, and a control (another seed, other dropout masks) must land
more than ``CONTROL_MARGIN`` bounds away.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orchestrator.accounting.summary import JobResult
from orchestrator.job.reading import load_job
from orchestrator.launch import run_job

#: The re-ordering a job's yardstick is measured with, as an override of a one-worker run: the
#: worker takes each step's shards in a seeded random order (policies/assignment.py), so a fused
#: pass concatenates their samples, and unfused passes add their gradients, in another order.
#: Nothing else changes: each shard still sees the same samples, and an unfused shard's forward
#: the same seed (``shard_seed``). Not a pure re-ordering for a fused job whose forward draws
#: random numbers (dropout): its one pass is seeded by its first shard.
REORDERED = "chaos.shuffle_shards=true"

#: How many yardsticks a run may end from its job's one-worker run. Another assignment of shards
#: to workers is another float order, like the yardstick's, so its distance is a draw from the
#: same spread. Measured over this suite's invariance tests: 0.77 to 2.44 yardsticks on this
#: machine's own kernels (AVX512), 0.80 to 2.05 under ATEN_CPU_CAPABILITY=default and 0.94 to
#: 1.22 under avx2. Both draws vary, so 10 leaves 4x room over the largest ratio seen, while the
#: controls (another seed, other dropout masks) land 4 x 10^4 to 3 x 10^6 bounds away.
YARDSTICK_MULTIPLE = 10.0

#: A control run (one that must differ: another seed, other dropout masks) must end more than
#: this many bounds from the reference, or the comparison could not tell it from noise.
CONTROL_MARGIN = 100.0


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def run(tmp_path: Path, name: str, *overrides: str) -> JobResult:
    """The built-in job, 25 steps and no eval unless overridden; asserts it finished. (Its
    ``shards_committed == shards_expected`` holds whenever a job finishes, by the census and
    ledger checks: those guards are shown to fire in tests/multiprocess/test_ledger.py.)"""
    job = load_job(None, ["steps=25", "eval=null", *overrides])
    result = run_job(job, run_dir=tmp_path / name)
    assert result.summary["status"] == "finished", result.summary.get("error")
    assert result.summary["shards_committed"] == result.summary["shards_expected"] == job.steps * job.shards
    return result


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _floats(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of ``want``'s floating-point tensors, checked to be in ``got`` with their shapes."""
    assert got.keys() == want.keys(), f"different tensors: {sorted(got.keys() ^ want.keys())}"
    for key, value in want.items():
        assert got[key].shape == value.shape, f"{key}: shape {tuple(got[key].shape)}, expected {tuple(value.shape)}"
    return [key for key, value in want.items() if value.is_floating_point()]


def distance(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> float:
    """How far ``got`` ended from ``want`` (final states, name -> tensor, with the same names and
    shapes): ``|got - want| / |want|``, the Euclidean norms taken over every element of every
    floating-point tensor at once, as one vector, in float64. NaN or a difference from an
    all-zero ``want`` is infinitely far. Other tensors (a BatchNorm's ``num_batches_tracked``)
    are not measured: ``assert_same_params`` requires them equal.

    Relative, so it reads the same for any job's scale. Over the whole state, so that float
    noise is averaged over many elements: the largest single difference is about one ulp of
    whichever element it lands on, so it jumps with that element's magnitude (a 4-step SGD job
    put a 4-worker run at 16 yardsticks by it, at 2 by this). And a tensor that is itself
    float noise (a bias whose true gradient is zero) counts by its size, not as a 100%
    difference, as it would tensor by tensor."""
    keys = _floats(got, want)
    diff = math.sqrt(sum(float((got[k].double() - want[k].double()).square().sum()) for k in keys))
    norm = math.sqrt(sum(float(want[k].double().square().sum()) for k in keys))
    if math.isnan(diff):
        return math.inf
    return diff / norm if norm else (0.0 if diff == 0 else math.inf)


def _largest_difference(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> str:
    """The largest absolute difference of any floating-point element, and where, in words (what
    a fixed tolerance would have judged; for messages only)."""
    each = {k: float((got[k].double() - want[k].double()).abs().max()) for k in _floats(got, want) if want[k].numel()}
    worst = max(each, key=lambda key: each[key], default=None)
    return "no element differs" if worst is None or each[worst] == 0 else f"largest difference {each[worst]:.3g} in {worst}"


@dataclass(frozen=True)
class Yardstick:
    """The float noise of a job on this machine: the ``distance`` between a clean one-worker run
    and the same run summed in another order (``how``). Positive and finite: a re-ordering that
    left the run bit for bit where it was measured nothing, and is refused."""

    value: float
    how: str

    def __post_init__(self) -> None:
        if self.value == 0:
            raise ValueError(
                f"no yardstick from '{self.how}': the re-ordered run ended bit for bit where the reference "
                "did. A re-ordering that changed nothing is no yardstick: re-order this job another way, "
                "one that changes its float sums and nothing else"
            )
        if not 0 < self.value < math.inf:
            raise ValueError(f"no yardstick from '{self.how}': the re-ordered run ended {self.value!r} from the reference")

    @classmethod
    def measure(cls, want: Mapping[str, torch.Tensor], reordered: Mapping[str, torch.Tensor], how: str) -> Yardstick:
        return cls(distance(reordered, want), how)

    @property
    def bound(self) -> float:
        """The farthest a run of the job may end from its one-worker run."""
        return YARDSTICK_MULTIPLE * self.value


class Reference(dict[str, torch.Tensor]):
    """A clean one-worker run's final state (name -> tensor, as ``params`` reads it), which other
    runs of its job must end at, with the job's ``yardstick`` and the run's directory (None
    where the state did not come from one)."""

    def __init__(self, state: Mapping[str, torch.Tensor], yardstick: Yardstick, run_dir: Path | None = None) -> None:
        super().__init__(state)
        self.yardstick = yardstick
        self.run_dir = run_dir


def reference_run(tmp_path: Path, *overrides: str) -> Reference:
    """``run``'s job with ``overrides`` on one worker, as ``w1`` under ``tmp_path``, and its
    yardstick from a second one-worker run with ``REORDERED`` (``w1-reordered``). ``overrides``
    must not ask for chaos (kills, stalls) or a worker count other than one."""
    plain = run(tmp_path, "w1", *overrides, "scaling.workers=1")
    state = params(plain.run_dir)
    reordered = params(run(tmp_path, "w1-reordered", *overrides, "scaling.workers=1", REORDERED).run_dir)
    return Reference(state, Yardstick.measure(state, reordered, f"one worker, {REORDERED}"), plain.run_dir)


def assert_same_params(got: Mapping[str, torch.Tensor], want: Reference, name: str) -> float:
    """``got`` ended where the one-worker run ``want`` did: its ``distance`` is at most
    ``YARDSTICK_MULTIPLE`` times the job's yardstick, and its non-float tensors are equal.
    Prints and returns the distance (pytest shows the line with ``-s``, or for a failed test)."""
    if not isinstance(want, Reference):
        raise TypeError(f"{name}: compare with a Reference (a one-worker run with its job's yardstick: reference_run)")
    found = distance(got, want)
    for key, value in want.items():
        if not value.is_floating_point():
            assert torch.equal(got[key], value), f"{name}: {key} is {got[key]}, expected {value}"
    largest = _largest_difference(got, want)
    ruler = want.yardstick
    print(
        f"closeness {name}: {found:.3g} = {found / ruler.value:.2f} yardsticks (yardstick {ruler.value:.3g}, "
        f"{ruler.how}); {largest}"
    )
    assert found <= ruler.bound, (
        f"{name}: ended {found:.3g} from the one-worker run (relative), more than {YARDSTICK_MULTIPLE:g} x this "
        f"job's yardstick {ruler.value:.3g} ({ruler.how}) = {ruler.bound:.3g}; {largest}"
    )
    return found


def assert_control_differs(got: Mapping[str, torch.Tensor], want: Reference, name: str) -> float:
    """A control, a run that must not end where ``want`` did, ends more than ``CONTROL_MARGIN``
    bounds from it: the comparison tells a real difference from float noise. Prints and returns
    its distance."""
    found = distance(got, want)
    ruler = want.yardstick
    print(f"control {name}: {found:.3g} = {found / ruler.bound:.3g} bounds (bound {ruler.bound:.3g})")
    assert found > CONTROL_MARGIN * ruler.bound, (
        f"control {name}: ended only {found:.3g} from the one-worker run, not {CONTROL_MARGIN:g} x the bound "
        f"{ruler.bound:.3g}: the comparison cannot tell it from float noise"
    )
    return found
