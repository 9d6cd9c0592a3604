"""Reading a job: a YAML file and ``--set`` overrides, validated into a ``JobConfig`` once, at
the edge, with messages that name the file and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from jobspec.fields import ConfigError, callable_name
from jobspec.job import JobConfig
from jobspec.recipe import BUILTIN_LOSSES, OptimizerConfig
from jobspec.redaction import masked
from jobspec.targets import as_callable, build, optional_callable
from policies.schedule import BUILTIN_SCHEDULES


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set a.b=value`` overrides (values parsed as YAML) to a raw job mapping."""
    result = dict(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set steps=50")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"--set {item!r}: value is not valid YAML ({err})") from None
        node = result
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"--set {item!r}: field '{where}' is not a mapping")
            node[part] = dict(child)
            node = node[part]
        node[parts[-1]] = value
    return result


def describe_errors(err: ValidationError, source: str, kind: str = "job") -> str:
    """Every problem pydantic found, one line each naming the field: ``invalid <kind> (<source>):``."""
    lines = [f"invalid {kind} ({source}):"]
    for problem in err.errors():
        field = ".".join(str(p) for p in problem["loc"]) or "(top level)"
        if problem["type"] == "extra_forbidden":
            message = "unknown field"
        else:
            message = problem["msg"].removeprefix("Value error, ")
        got = problem.get("input")
        shown = "" if problem["type"] in ("missing",) or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  field '{field}': {message}{shown}")
    return "\n".join(lines)


def load_job(path: str | Path | None, overrides: list[str] | None = None, *, resolve: bool = True) -> JobConfig:
    """Read, override and validate a job. ``path=None`` gives the built-in example.

    With ``resolve`` (the default) also runs ``resolve_job``; without it nothing heavy is
    imported, and the caller must run ``resolve_job`` before any worker starts.
    Raises ConfigError naming the file and field on any problem.
    """
    source = job_source(path)
    raw = read_mapping(path, source) if path is not None else {}
    raw = apply_overrides(_defaults_overridden(raw, overrides or []), overrides or [])
    hidden = _masked_fields(raw)
    if hidden:
        raise ConfigError(
            f"invalid job ({source}): field(s) {', '.join(repr(f) for f in hidden)} hold a credential that was masked "
            f"when the run was saved; give each again without it (--set {hidden[0]}=s3://bucket/..., the credential "
            "in the storage's own environment), or with it (ringleader submit ships --set values in a file, not on "
            "a command line)"
        )
    job = job_from_mapping(raw, source)
    if resolve:
        resolve_job(job, source)
    return job


def _defaults_overridden(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``raw`` with the default of each section it leaves out (``dataset``, say) where an
    override sets a field inside it other than one that names a new source (``NEW_SOURCE``):
    ``--set dataset.shuffle=permutation`` on the built-in job changes the built-in dataset;
    ``--set dataset.factory=...`` names another dataset, whose fields start from nothing."""
    keys = [item.partition("=")[0].split(".") for item in overrides]
    result = dict(raw)
    for section in {key[0] for key in keys if len(key) > 1} - set(raw):
        field = JobConfig.model_fields.get(section)
        default = field.default if field is not None else None
        # A section set whole (``--set dataset={...}``) or given a new source starts from nothing.
        fresh = any(key[0] == section and (len(key) == 1 or key[1] in NEW_SOURCE) for key in keys)
        if isinstance(default, BaseModel) and not fresh:
            result[section] = default.model_dump(mode="json", exclude_unset=True)
    return result


#: The fields that name where a section's model or data come from: set one, and the section is new.
NEW_SOURCE = frozenset({"factory", "files"})


def read_mapping(path: str | Path, source: str, kind: str = "job") -> dict[str, Any]:
    """A YAML file's top-level mapping (empty file: empty). Raises ConfigError naming the
    ``<kind> file`` if it cannot be read, is not YAML, or is not a mapping."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read {kind} file {source}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        byte = err.object[err.start]
        raise ConfigError(f"{kind} file {source} is not UTF-8 text (byte {byte:#04x} at offset {err.start})") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{kind} file {source} is not valid YAML: {err}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{kind} file {source}: expected a mapping at the top level")
    return loaded


def encode_overrides(overrides: list[str]) -> bytes:
    """``--set`` overrides as the file ``read_overrides`` (``ringleader run --set-file``)
    reads: a JSON list of strings."""
    return json.dumps(list(overrides)).encode()


def read_overrides(path: str | Path) -> list[str]:
    """The overrides ``encode_overrides`` encoded, from ``path``. Raises ConfigError naming the file
    if it cannot be read or is not a JSON list of strings."""
    try:
        loaded = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"cannot read --set-file {path}: {err.strerror}") from None
    except ValueError as err:  # not JSON, or not UTF-8
        raise ConfigError(f"--set-file {path} is not a JSON list of FIELD=VALUE strings ({err})") from None
    if not isinstance(loaded, list) or not all(isinstance(item, str) for item in loaded):
        raise ConfigError(f"--set-file {path} is not a JSON list of FIELD=VALUE strings")
    return loaded


def job_from_mapping(raw: dict[str, Any], source: str) -> JobConfig:
    """Validate ``raw`` (a job file's mapping, or the Python API's) into a JobConfig; nothing
    heavy is imported. Raises ConfigError naming ``source`` and every bad field."""
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_errors(err, source)) from None


def _masked_fields(raw: Any, where: str = "") -> list[str]:
    """Dotted names of the fields whose values ``jobspec.redaction`` masked."""
    if isinstance(raw, dict):
        return [f for key, value in raw.items() for f in _masked_fields(value, f"{where}.{key}" if where else str(key))]
    if isinstance(raw, list):
        return [f for index, value in enumerate(raw) for f in _masked_fields(value, f"{where}.{index}")]
    return [where] if isinstance(raw, str) and masked(raw) else []


def job_source(path: str | Path | None) -> str:
    """How messages name where a job came from."""
    return "built-in example" if path is None else str(path)


def _function_fields(job: JobConfig) -> dict[str, Any]:
    """Every field of ``job`` that names a function or class to import, by its dotted name."""
    found: dict[str, Any] = {"model.factory": job.model.factory, "dataset.factory": job.dataset.factory}
    found["dataset.collate"] = job.dataset.collate
    if job.eval is not None:
        found.update({"eval.factory": job.eval.factory, "eval.collate": job.eval.collate, "eval.metrics": job.eval.metrics})
    for index, spec in enumerate(job.tracking.callbacks):
        found[f"tracking.callbacks.{index}.factory"] = spec.factory
    if job.loss.name not in BUILTIN_LOSSES:
        found["loss.name"] = job.loss.name
    if job.schedule.name not in BUILTIN_SCHEDULES:
        found["schedule.name"] = job.schedule.name
    return {field: target for field, target in found.items() if target is not None}


def resolve_job(job: JobConfig, source: str) -> None:
    """The checks that import user code and torch: each import path names a callable, and
    the optimizer exists and accepts its kwargs (so they fail here, not in a worker). Raises
    ConfigError naming every bad field.
    """
    problems: list[str] = []
    for field, target in _function_fields(job).items():
        try:
            as_callable(target)
        except ValueError as err:
            problems.append(f"  field '{field}': {err} (got {callable_name(target)!r})")
    problem = optimizer_problem(job.optimizer) or sharding_problem(job)
    if problem:
        problems.append(problem)
    if problems:
        raise ConfigError("\n".join([f"invalid job ({source}):", *problems]))


def check_loss(job: JobConfig, source: str) -> None:
    """Call a user's loss once on the driver, on a batch of the job's first two samples, and
    raise ConfigError naming ``loss`` if it returns a scalar (a mean: see
    ``workers/model/objective.py``); the built-ins are known to keep the contract.

    The model is built on torch's ``meta`` device and the batch moved there: shapes without
    memory, so a large model costs the driver (a small head node, perhaps) nothing. The
    dataset factory does run here: the launch runs this in a child process it kills after
    ``LOSS_CHECK_S`` (``orchestrator/job/loss_check.py``). Anything that fails on the way (a factory that needs real tensors or a GPU, a
    forward or loss that reads values, the driver lacking the workers' data) is left to the
    workers, which refuse a scalar at step 0 and report anything else as before."""
    if job.loss.name in BUILTIN_LOSSES:
        return
    import numpy as np
    import torch

    from workers.data.batches import fetch_batch, move_to
    from workers.model.objective import Objective, ScalarLossError

    meta = torch.device("meta")
    try:
        objective = Objective(job.loss.name, job.loss.kwargs)
        with meta:  # every tensor the factory makes, parameters and buffers, is shape only
            model = build(job.model.factory, job.model.kwargs)
        dataset = build(job.dataset.factory, job.dataset.kwargs)
        samples = min(2, len(dataset))
        batch = fetch_batch(dataset, np.arange(samples), optional_callable(job.dataset.collate))
        with torch.no_grad(), meta:
            result = objective.fn(model, move_to(batch, meta), **objective.kwargs)
        objective.check(result, samples)
    except ScalarLossError as err:
        raise ConfigError(f"invalid job ({source}):\n  {err}") from None
    except Exception:  # noqa: BLE001 - the workers build and call these again, and report it there
        return


def sharding_problem(job: JobConfig) -> str | None:
    """With sharded optimizer state and a generic optimizer: a line naming
    ``sharding.group_size`` if the optimizer steps a slice of a parameter otherwise than the
    whole parameter (``workers/sharding/slice_steppers.py``, ``check_element_wise``), else None."""
    if not job.sharding.enabled or job.optimizer.is_fused:
        return None
    from workers.sharding.slice_steppers import check_element_wise

    try:
        check_element_wise(job.optimizer.name, job.optimizer.kwargs)
    except ValueError as err:
        return f"  {err}"
    return None


def optimizer_problem(config: OptimizerConfig) -> str | None:
    """What is wrong with the optimizer, as a line naming the field, or None. A generic
    optimizer is built once on a stand-in parameter, so its kwargs are checked by its own
    constructor."""
    import torch  # kept off the light path

    from workers.optim.fused import check_decay_groups, parse_optimizer
    from workers.optim.generic import resolve_optimizer_class

    if config.is_fused:
        try:
            settings = parse_optimizer(config.name, config.kwargs)
            if not config.decay_biases_and_norms:
                check_decay_groups(config.name, settings)
        except (TypeError, ValueError) as err:
            return f"  field 'optimizer.kwargs': {err}"
        return None
    try:
        cls = resolve_optimizer_class(config.name)
    except ValueError as err:
        return f"  field 'optimizer.name': {err}"
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **config.kwargs)
    except (TypeError, ValueError) as err:
        return f"  field 'optimizer.kwargs': {callable_name(config.name)}: {err}"
    return None
