"""The schema's building blocks: the error a bad job raises, the strict frozen base model, and the
field types that name user code (an import path, a built-in's name, or the callable itself).

Validating an import path here imports only its parent packages: user modules (and torch with
them) are imported by ``orchestrator/job/reading.py``'s ``resolve_job``, off the fast path.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator

from jobspec.targets import locate_import_path, resolve_import_path


class ConfigError(Exception):
    """A job file or override is invalid. ``str(err)`` is the message for the user."""


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its type's name if it has none): how another
    library's error is quoted in a one-line message for the user."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class StrictModel(BaseModel):
    """Unknown keys are errors; a validated model never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _import_path_or_callable(value: Any) -> str | Callable[..., Any]:
    # Importing the module (and torch with it) is left to resolve_job, off the fast path.
    if callable(value):
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected 'package.module:function' or a Python callable, got {type(value).__name__}")
    locate_import_path(value)
    return value


def callable_name(value: str | Callable[..., Any]) -> str:
    """An import path as it is; a callable as the ``module:qualname`` that imports it again
    (what job.json records), or, when that would import something else (a lambda, a local
    function, a ``functools.partial``, an instance, anything in ``__main__``), as
    ``<not importable: module:qualname>``, which no job file accepts: such a job is resumed
    by passing it again."""
    if isinstance(value, str):
        return value
    module = getattr(value, "__module__", None) or "?"
    name = f"{module}:{getattr(value, '__qualname__', type(value).__qualname__)}"
    try:
        importable = module != "__main__" and resolve_import_path(name) is value
    except ValueError:
        importable = False
    return name if importable else f"<not importable: {name}>"


def _json_value(value: Any) -> Any:
    """``value`` as JSON: containers element by element, callables by ``callable_name``, any
    other object by its ``repr`` (kwargs from the Python API may hold classes and objects)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if callable(value):
        return callable_name(value)
    return repr(value)


#: Keyword arguments for a user's function or class: anything goes in Python; JSON (job.json,
#: the trajectory hash) holds what is not plain data by name (see ``_json_value``).
Kwargs = Annotated[dict[str, Any], PlainSerializer(_json_value, when_used="json")]


#: A ``package.module:function`` path, or (from the Python API) the callable itself, which Ray
#: ships to the workers by value. Written to JSON as its ``module:qualname``.
ImportTarget = Annotated[
    Any, PlainValidator(_import_path_or_callable), PlainSerializer(callable_name, when_used="json")
]


def _name_path_or_callable(value: Any) -> str | Callable[..., Any]:
    # A plain name (no colon) is a built-in's, checked by the field's own validator.
    if isinstance(value, str) and ":" not in value:
        return value
    return _import_path_or_callable(value)


def builtin_or_path(value: Any, builtins: tuple[str, ...], kind: str) -> Any:
    if isinstance(value, str) and ":" not in value and value not in builtins:
        raise ValueError(f"unknown {kind} {value!r}: use one of {list(builtins)} or 'package.module:function'")
    return value


#: A built-in's name, a ``package.module:function`` path or a callable.
NamedTarget = Annotated[
    Any, PlainValidator(_name_path_or_callable), PlainSerializer(callable_name, when_used="json")
]


class FactorySpec(StrictModel):
    """A ``module:function`` (or callable) that builds a model or dataset, with keyword arguments."""

    factory: ImportTarget
    kwargs: Kwargs = Field(default_factory=dict)
