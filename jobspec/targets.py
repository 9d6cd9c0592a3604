"""Resolve the ``package.module:function`` paths (or callables) that name a job's factories and functions."""

from __future__ import annotations

import importlib
import importlib.util
import re
from typing import Any, Callable

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def locate_import_path(path: str) -> tuple[str, str]:
    """Check ``"package.module:attr"`` without importing the module (only its parent packages).

    Returns ``(module, attr)``. Raises ValueError if the syntax is off or no such module exists.
    Cheap, so job files fail fast; ``resolve_import_path`` does the full check.
    """
    if not _IMPORT_PATH.match(path):
        raise ValueError(f"expected 'package.module:function', got {path!r}")
    module_name, attr_path = path.split(":", 1)
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as err:
        raise ValueError(f"cannot import module {module_name!r} ({err})") from None
    if found is None:
        raise ValueError(f"cannot import module {module_name!r} (No module named {module_name!r})")
    return module_name, attr_path


def resolve_import_path(path: str) -> Callable[..., Any]:
    """Import ``"package.module:attr"`` and return the callable it names.

    Raises ValueError with a message saying which part did not resolve.
    """
    module_name, attr_path = locate_import_path(path)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} ({err})") from None
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ValueError(f"module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ValueError(f"{path!r} is not callable")
    return obj


def as_callable(target: str | Callable[..., Any]) -> Callable[..., Any]:
    """``target`` itself if it is callable (from the Python API), else the callable its import
    path names (see ``resolve_import_path``)."""
    return target if callable(target) else resolve_import_path(target)


def optional_callable(target: str | Callable[..., Any] | None) -> Callable[..., Any] | None:
    return None if target is None else as_callable(target)


def build(target: str | Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """Call the factory ``target`` (a callable or an import path) with ``kwargs``."""
    return as_callable(target)(**kwargs)
