"""``ringleader tune JOB --param FIELD=DIST(...) --samples N [--scheduler asha]``: a Ray Tune
sweep whose trials are elastic ringleader jobs.

Each trial reserves one placement group: a small bundle for the trial itself (the job's driver)
and one bundle per worker up to ``scaling.max_workers``; its workers run in those bundles
(``RayWorkerGroup(within=...)``), so trials never take resources beyond what Tune gave them,
and a dead worker is replaced in its own trial's bundle. Every committed step is reported to
Tune (``loss``, ``step``, ``lr``, ...), so a scheduler such as ASHA stops bad trials early.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobspec.fields import ConfigError
from jobspec.job import JobConfig
from orchestrator.job.reading import apply_overrides, job_from_mapping, load_job, resolve_job

#: ``FIELD=NAME(ARGS)``; NAME one of DISTRIBUTIONS.
_PARAM = re.compile(r"^(?P<field>[A-Za-z_][\w.]*)=(?P<name>\w+)\((?P<args>.*)\)$")
DISTRIBUTIONS = ("uniform", "loguniform", "randint", "choice", "grid")
#: The trial's own bundle: it only drives the job.
DRIVER_BUNDLE = {"CPU": 0.01}


@dataclass(frozen=True)
class Param:
    """A searched field: its dotted name, the distribution and its arguments."""

    field: str
    distribution: str
    args: tuple[Any, ...]

    def to_tune(self) -> Any:
        from ray import tune

        if self.distribution == "choice":
            return tune.choice(list(self.args))
        if self.distribution == "grid":
            return tune.grid_search(list(self.args))
        return getattr(tune, self.distribution)(*self.args)


def parse_param(text: str) -> Param:
    """``"optimizer.kwargs.lr=loguniform(1e-4, 1e-1)"`` as a Param. Raises ConfigError naming
    the ``--param`` if the syntax, the distribution or its arguments are off."""
    match = _PARAM.match(text.replace(" ", ""))
    if not match:
        raise ConfigError(f"--param {text!r}: expected FIELD=DISTRIBUTION(ARGS), e.g. optimizer.kwargs.lr=loguniform(1e-4,1e-1)")
    name = match["name"]
    if name not in DISTRIBUTIONS:
        raise ConfigError(f"--param {text!r}: unknown distribution {name!r}; use one of {list(DISTRIBUTIONS)}")
    try:
        args = ast.literal_eval(f"({match['args']},)")
    except (ValueError, SyntaxError):
        raise ConfigError(f"--param {text!r}: arguments are not Python literals") from None
    if name in ("uniform", "loguniform", "randint"):
        if len(args) != 2 or not all(isinstance(a, (int, float)) for a in args) or not args[0] < args[1]:
            raise ConfigError(f"--param {text!r}: {name} takes two numbers, low < high")
        if name == "loguniform" and args[0] <= 0:
            raise ConfigError(f"--param {text!r}: loguniform needs low > 0")
    elif len(args) == 1 and isinstance(args[0], list):
        args = tuple(args[0])  # choice([a, b]) as well as choice(a, b)
    if name in ("choice", "grid") and not args:
        raise ConfigError(f"--param {text!r}: {name} needs at least one value")
    return Param(match["field"], name, tuple(args))


def trial_job(base: dict[str, Any], config: dict[str, Any]) -> JobConfig:
    """The base job (a job file's mapping) with a trial's values set. Raises ConfigError."""
    overrides = [f"{field}={json.dumps(value)}" for field, value in config.items()]
    return job_from_mapping(apply_overrides(base, overrides), f"trial {config}")


class TuneReporter:
    """A run listener reporting each committed step (and the eval) to Tune."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def on_event(self, record: dict[str, Any]) -> None:
        from ray import tune

        if record["event"] == "step":
            self.last = {
                k: float(record[k]) for k in ("loss", "lr", "grad_norm", "step_s") if isinstance(record.get(k), (int, float))
            }
            tune.report({**self.last, "step": record["step"] + 1})
        elif record["event"] == "eval" and self.last:
            metrics = {f"eval_{k}": float(v) for k, v in record.get("metrics", {}).items() if isinstance(v, (int, float))}
            tune.report({**self.last, "step": record["step"], **metrics})

    def on_model(self, path: Path) -> None:
        pass

    def on_summary(self, summary: dict[str, Any]) -> None:
        pass


def _trial(config: dict[str, Any], base: dict[str, Any], runs: str) -> None:
    from ray import tune
    from ray.util import get_current_placement_group

    from orchestrator.launch import run_job

    job = trial_job(base, config)
    run_dir = Path(runs) / tune.get_context().get_trial_id()
    result = run_job(job, run_dir=run_dir, listeners=[TuneReporter()], within=get_current_placement_group())
    if result.summary["status"] != "finished":
        raise RuntimeError(f"trial job {result.summary['status']}: {result.summary.get('error')}")


def run_sweep(
    job_file: str | None,
    params: Sequence[str],
    samples: int,
    *,
    scheduler: str | None = None,
    overrides: Sequence[str] = (),
    storage: Path = Path("runs/tune"),
    metric: str = "loss",
) -> list[dict[str, Any]]:
    """Run the sweep on the Ray this process has (or a fresh local one); returns the trials
    ranked by their last ``metric`` (lowest first): ``{trial, config, loss, step, status,
    run_dir, ...}``. Raises ConfigError for a bad job or ``--param`` before any trial starts."""
    import yaml
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    if samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {samples}")
    searched = [parse_param(text) for text in params]
    if not searched:
        raise ConfigError("tune needs at least one --param FIELD=DISTRIBUTION(ARGS)")
    job = load_job(job_file, list(overrides))  # the base job, checked whole (imports included)
    raw = yaml.safe_load(Path(job_file).read_text()) if job_file else None
    base = apply_overrides(raw if isinstance(raw, dict) else {}, list(overrides))
    for param in searched:  # every searched field exists and takes the distribution's kind of value
        resolve_job(trial_job(base, {param.field: param.args[0]}), f"--param {param.field}")
    bundle = {k: v for k, v in job.scaling.resources_per_worker.items() if v > 0}
    trainable = tune.with_resources(
        tune.with_parameters(_trial, base=base, runs=str(storage.absolute() / "trials")),
        tune.PlacementGroupFactory([DRIVER_BUNDLE] + [bundle] * job.scaling.max_workers, strategy=job.scaling.placement_strategy),
    )
    steps = job.steps or 1
    tuner = tune.Tuner(
        trainable,
        param_space={p.field: p.to_tune() for p in searched},
        tune_config=tune.TuneConfig(
            num_samples=samples, metric=metric, mode="min",
            # max_t past the last step: a trial that reached it still ends its job (eval, save).
            scheduler=ASHAScheduler(time_attr="step", max_t=steps + 1, grace_period=max(1, steps // 4))
            if scheduler == "asha" else None,
        ),
        run_config=tune.RunConfig(storage_path=str(storage.absolute()), name=job.name, verbose=0),
    )
    results = tuner.fit()
    ranked = []
    for result in results:
        metrics = result.metrics or {}
        ranked.append({
            "trial": metrics.get("trial_id"), "config": result.config, metric: metrics.get(metric),
            "step": metrics.get("step"), "status": "error" if result.error else "ok",
            "run_dir": str(storage.absolute() / "trials" / str(metrics.get("trial_id"))),
            **{k: v for k, v in metrics.items() if k.startswith("eval_")},
        })
    return sorted(ranked, key=lambda r: (r[metric] is None, r[metric] if r[metric] is not None else 0.0))


def format_ranking(ranked: list[dict[str, Any]], metric: str = "loss") -> str:
    lines = [f"{'rank':>4s} {'trial':>12s} {metric:>10s} {'step':>5s}  config"]
    for rank, row in enumerate(ranked, 1):
        value = f"{row[metric]:.4f}" if row[metric] is not None else "-"
        lines.append(f"{rank:4d} {str(row['trial']):>12s} {value:>10s} {str(row['step']):>5s}  {json.dumps(row['config'])}")
    return "\n".join(lines)
