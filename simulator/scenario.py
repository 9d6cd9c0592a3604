"""A simulation scenario (``ringleader simulate SCENARIO.yaml``): the cluster, its failures and
slowdowns, what recovery and checkpoints cost, and the cost models. Validated once, here; every
field has a working default (``examples/sim-4096.yaml`` says where the figures come from).
Times are seconds unless a name says otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from jobspec.fields import ConfigError
from jobspec.stragglers import StragglerConfig
from orchestrator.job.reading import apply_overrides, describe_errors, read_mapping

CONTENDERS = ("ringleader", "no_mitigation", "restart_world")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Workload(StrictModel):
    """One data-parallel step at nominal speed: ``compute_s`` of forward, backward and optimizer
    on each worker's even share, ``backward_share`` of it backward (the window overlap hides
    the all-reduce in), the global batch cut into ``shards_per_worker`` x workers shards."""

    compute_s: float = Field(1.0, gt=0)
    backward_share: float = Field(0.6, ge=0, le=1)
    shards_per_worker: int = Field(4, ge=1)
    jitter: float = Field(0.02, ge=0, le=1, description="log-normal sigma of a worker's step-to-step noise")


class NodeType(StrictModel):
    """A share of the nodes computing at ``speed`` x nominal (heterogeneous fleets)."""

    fraction: float = Field(gt=0, le=1)
    speed: float = Field(gt=0)


class SlowNodes(StrictModel):
    """``count`` nodes persistently ``factor`` x slower (thermal throttling, a bad DIMM)."""

    count: int = Field(0, ge=0)
    factor: float = Field(3.0, ge=1)


class TransientSlowdowns(StrictModel):
    """At any moment ``fraction`` of the workers are in a slowdown episode lasting ``mean_steps``
    on average (geometric), computing ``factor`` x slower."""

    fraction: float = Field(0.05, ge=0, lt=1)
    factor: float = Field(2.0, ge=1)
    mean_steps: float = Field(20.0, ge=1)


class Failures(StrictModel):
    """Node failures as a Poisson process: each node fails after ``node_mtbf_h`` hours on average
    (0 nodes failing: ``node_mtbf_h`` null). ``at_s``: failures at fixed times instead (tests,
    what-ifs)."""

    node_mtbf_h: float | None = Field(None, gt=0)
    at_s: list[float] = Field(default_factory=list)


class InPlaceRecovery(StrictModel):
    """ringleader's recovery (docs/architecture.md, "Recovery"): ``detect_s`` until the driver
    sees the death, ``reform_s`` to re-form the survivors' group; the interrupted step is redone.
    A replacement node comes ``replacement_s`` after the failure and joins at a step boundary
    for ``join_s``."""

    detect_s: float = Field(5.0, ge=0)
    reform_s: float = Field(30.0, ge=0)
    replacement_s: float = Field(600.0, ge=0)
    join_s: float = Field(30.0, ge=0)


class RestartTheWorld(StrictModel):
    """Ray Train's and torchrun's recovery: every worker restarts (``restart_s``: relaunch,
    rendezvous, load the last checkpoint) and the steps since that checkpoint are redone. A
    checkpoint holds training up ``checkpoint_s``; ``checkpoint_every_steps`` null: the
    Young/Daly interval for the true MTBF (the best a user could pick)."""

    restart_s: float = Field(600.0, ge=0)
    checkpoint_s: float = Field(60.0, ge=0)
    checkpoint_every_steps: int | None = Field(None, ge=1)


class Snapshots(StrictModel):
    """ringleader's checkpoints: the in-memory snapshot holds training up ``snapshot_s``; the
    write runs in the background. The interval is the job's policy (Young/Daly, measured)."""

    snapshot_s: float = Field(2.0, ge=0)


class ControlPlane(StrictModel):
    """The driver's cost per step, ``fixed_ms + per_worker_ms x N`` (``ringleader bench
    control-plane`` fits both). The driver works ahead of the workers (run-ahead), so a step takes at least this."""

    fixed_ms: float = Field(1.0, ge=0)
    per_worker_ms: float = Field(0.0, ge=0)


class LinkCost(StrictModel):
    """One hop: ``latency_us`` and ``bandwidth_gb_s`` (GB/s, one direction)."""

    latency_us: float = Field(ge=0)
    bandwidth_gb_s: float = Field(gt=0)


class CollectiveCost(StrictModel):
    """The gradient all-reduce: ``gradient_mb`` in buckets of ``bucket_mb``, by ``algorithm``
    over ``intra`` (within a node) and ``inter`` (between nodes) links (policies/collective_cost.py)."""

    algorithm: Literal["ring", "hierarchical"] = "hierarchical"
    gradient_mb: float = Field(1000.0, gt=0)
    bucket_mb: float = Field(25.0, gt=0)
    intra: LinkCost = LinkCost(latency_us=3.0, bandwidth_gb_s=360.0)
    inter: LinkCost = LinkCost(latency_us=10.0, bandwidth_gb_s=45.0)


class Scenario(StrictModel):
    """What ``ringleader simulate`` runs: ``workers`` in nodes of ``workers_per_node``, for
    ``steps``, each contender in ``contenders`` on the same draws (``seed``)."""

    name: str = "scenario"
    workers: int = Field(64, ge=2)
    workers_per_node: int = Field(8, ge=1)
    steps: int = Field(1000, ge=1)
    seed: int = 0
    contenders: list[Literal["ringleader", "no_mitigation", "restart_world"]] = Field(default_factory=lambda: list(CONTENDERS))
    workload: Workload = Workload()
    node_types: list[NodeType] = Field(default_factory=lambda: [NodeType(fraction=1.0, speed=1.0)])
    slow_nodes: SlowNodes = SlowNodes()
    transient: TransientSlowdowns = TransientSlowdowns()
    failures: Failures = Failures()
    recovery: InPlaceRecovery = InPlaceRecovery()
    restart: RestartTheWorld = RestartTheWorld()
    snapshots: Snapshots = Snapshots()
    control_plane: ControlPlane = ControlPlane()
    collective: CollectiveCost = CollectiveCost()
    stragglers: StragglerConfig = StragglerConfig()

    @model_validator(mode="after")
    def _shape(self) -> "Scenario":
        if self.workers % self.workers_per_node:
            raise ValueError(f"workers ({self.workers}) must be a multiple of workers_per_node ({self.workers_per_node})")
        if self.slow_nodes.count > self.nodes:
            raise ValueError(f"slow_nodes.count ({self.slow_nodes.count}) is more than the {self.nodes} nodes")
        total = sum(t.fraction for t in self.node_types)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"node_types fractions must add up to 1, got {total:g}")
        if not self.contenders:
            raise ValueError("contenders: name at least one of " + ", ".join(CONTENDERS))
        return self

    @property
    def nodes(self) -> int:
        return self.workers // self.workers_per_node


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    """Read and validate a scenario file (``--set a.b=value`` overrides as for jobs). A file may
    name another as ``extends`` (a path relative to it): that one is read first and this one's
    fields laid over it, section by section. Raises ConfigError naming the file and every bad
    field (or the chain of files extending each other in a loop)."""
    raw = apply_overrides(_read_extended(Path(path), ()), overrides or [])
    try:
        return Scenario.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_errors(err, str(path), "scenario")) from None


def _read_extended(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    """``path``'s mapping laid over the one it ``extends``, if any (``chain``: the files
    extending it, to refuse a loop)."""
    raw = read_mapping(path, str(path), "scenario")
    base = raw.pop("extends", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{path}: field 'extends': expected the path of another scenario file, got {base!r}")
    parent = (path.parent / base).resolve()
    if parent in chain or parent == path.resolve():
        raise ConfigError(f"{path}: field 'extends': {base} extends this file again (a loop)")
    return _laid_over(_read_extended(parent, (*chain, path.resolve())), raw)


def _laid_over(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over``'s fields over ``base``'s, sections (mappings) merged field by field."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _laid_over(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
