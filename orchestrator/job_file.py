"""Reading a job: a YAML file and ``--set`` overrides, validated into a ``JobConfig`` once, at
the edge, with messages that name the file and the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from orchestrator.config import ConfigError, FactorySpec, JobConfig
from orchestrator.redaction import masked
from workers.factories import resolve_import_path


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


def _describe(err: ValidationError, source: str) -> str:
    lines = [f"invalid job ({source}):"]
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
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ConfigError(f"cannot read job file {source}: {err.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"job file {source} is not valid YAML: {err}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"job file {source}: expected a mapping at the top level")
        raw = loaded
    raw = apply_overrides(raw, overrides or [])
    hidden = _masked_fields(raw)
    if hidden:
        raise ConfigError(
            f"invalid job ({source}): field(s) {', '.join(repr(f) for f in hidden)} hold a credential that was masked "
            "when the run was saved; give each again, e.g. --set " + f"{hidden[0]}=s3://KEY:SECRET@bucket/..."
        )
    try:
        job = JobConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err, source)) from None
    if resolve:
        resolve_job(job, source)
    return job


def _masked_fields(raw: Any, where: str = "") -> list[str]:
    """Dotted names of the fields whose values ``orchestrator.redaction`` masked."""
    if isinstance(raw, dict):
        return [f for key, value in raw.items() for f in _masked_fields(value, f"{where}.{key}" if where else str(key))]
    if isinstance(raw, list):
        return [f for index, value in enumerate(raw) for f in _masked_fields(value, f"{where}.{index}")]
    return [where] if isinstance(raw, str) and masked(raw) else []


def job_source(path: str | Path | None) -> str:
    """How messages name where a job came from."""
    return "built-in example" if path is None else str(path)


def resolve_job(job: JobConfig, source: str) -> None:
    """The checks that import user code and torch: each factory path names a callable, and
    the optimizer accepts its kwargs (so they fail here, not in a worker). Raises ConfigError
    naming every bad field.
    """
    from workers.flat_optimizer import parse_optimizer  # torch import kept off the light path

    problems: list[str] = []
    for name in ("model", "dataset", "eval"):
        spec: FactorySpec | None = getattr(job, name)
        if spec is None:
            continue
        try:
            resolve_import_path(spec.factory)
        except ValueError as err:
            problems.append(f"  field '{name}.factory': {err} (got {spec.factory!r})")
    try:
        parse_optimizer(job.optimizer.name, job.optimizer.kwargs)
    except (TypeError, ValueError) as err:
        problems.append(f"  field 'optimizer.kwargs': {err}")
    if problems:
        raise ConfigError("\n".join([f"invalid job ({source}):", *problems]))
