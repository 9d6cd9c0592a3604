"""Deprecated: the job schema moved beneath the driver, to ``jobspec/`` (``jobspec.job.JobConfig``
and its sections in ``jobspec.recipe``, ``runtime``, ``chaos``, ``stragglers``, ``fields``);
``ringleader.JobConfig`` and ``ringleader.ConfigError`` are the public names.

Kept so scripts that imported from here still run: each name is looked up in its new home,
with a FutureWarning (shown to users, unlike a DeprecationWarning) naming where it went.
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

from jobspec import chaos, fields, job, recipe, runtime, stragglers

_HOMES: tuple[ModuleType, ...] = (job, recipe, runtime, chaos, stragglers, fields)


def __getattr__(name: str) -> Any:
    for home in _HOMES:
        if not name.startswith("__") and hasattr(home, name):
            warnings.warn(
                f"orchestrator.config is deprecated: import {name} from {home.__name__} "
                "(or ringleader.JobConfig / ringleader.ConfigError)",
                FutureWarning,
                stacklevel=2,
            )
            return getattr(home, name)
    raise AttributeError(f"module 'orchestrator.config' has no attribute {name!r}")
