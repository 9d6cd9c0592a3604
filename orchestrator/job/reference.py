"""The job-file reference (``docs/job-file.md``), generated from the pydantic models of
the job schema (``jobspec/``) so it cannot drift from them: ``tests/pure/test_config.py`` fails when
the file is stale. Regenerate with::

    python -m orchestrator.job.reference > docs/job-file.md
"""

from __future__ import annotations

import inspect
import json
import sys
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from jobspec.fields import _import_path_or_callable, _name_path_or_callable
from jobspec.job import JobConfig

HEADER = """# Job file reference

Every field of a job file (YAML), with its type and default; a job file may leave any field
out. Generated from the pydantic models of the job schema (`jobspec/`) by
`python -m orchestrator.job.reference > docs/job-file.md` (a test fails when this file is
stale). `--set FIELD=VALUE` takes the dotted names below.
"""


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``X``, ``X | None``, ``list[X]``)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _field_type(field: Any) -> str:
    """A field's type for people; the import-path fields by what they accept."""
    validators = [getattr(m, "func", None) for m in field.metadata]
    if _name_path_or_callable in validators:
        return "name \\| import path \\| callable"
    if _import_path_or_callable in validators:
        return "import path \\| callable"
    return _type_name(field.annotation)


def _type_name(annotation: Any) -> str:
    if annotation is Any:
        return "any"
    if annotation is type(None):
        return "null"
    if inspect.isclass(annotation) and not typing.get_args(annotation):
        return annotation.__name__
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is typing.Annotated:
        base = args[0]
        return "import path \\| callable" if base is Any else _type_name(base)
    name = getattr(origin, "__name__", str(origin))
    return f"{name}[{', '.join(_type_name(a) for a in args)}]"


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "see below"
    return f"`{json.dumps(value, default=str)}`"


def _doc(model: type[BaseModel]) -> str:
    text = inspect.getdoc(model) or ""
    return " ".join(text.split())


def reference() -> str:
    """The whole reference, as Markdown."""
    sections: list[str] = [HEADER]
    queue: list[tuple[str, type[BaseModel]]] = [("", JobConfig)]
    while queue:
        prefix, model = queue.pop(0)
        title = f"`{prefix}`" if prefix else "The job"
        rows = ["| field | type | default | description |", "| --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            dotted = f"{prefix}.{name}" if prefix else name
            rows.append(
                f"| `{dotted}` | {_field_type(field)} | {_default(field)} | {field.description or ''} |"
            )
            for nested in _models_in(field.annotation):
                is_list = typing.get_origin(field.annotation) is list
                queue.append((f"{dotted}[]" if is_list else dotted, nested))
        sections.append(f"## {title} ({model.__name__})\n\n{_doc(model)}\n\n" + "\n".join(rows) + "\n")
    return "\n".join(sections)


if __name__ == "__main__":
    sys.stdout.write(reference())
