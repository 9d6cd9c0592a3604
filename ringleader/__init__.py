"""ringleader's Python API: train a job from a script or a notebook, without a job file.

    import ringleader
    result = ringleader.run({"model": {"factory": make_model}, "loss": my_loss, "steps": 100})

See ``ringleader.api`` for the contract, docs/python-api.md for a complete example.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobspec.fields import ConfigError
    from jobspec.job import JobConfig
    from ringleader.api import LaunchOptions, RunResult, resume, run

#: Each public name and the module it comes from. Imported on first use, so the command line
#: (``ringleader.cli``, in this package) starts without the schema and pydantic behind it.
_HOMES = {
    "ConfigError": "jobspec.fields",
    "JobConfig": "jobspec.job",
    "LaunchOptions": "ringleader.api",
    "RunResult": "ringleader.api",
    "resume": "ringleader.api",
    "run": "ringleader.api",
}

__all__ = ["ConfigError", "JobConfig", "LaunchOptions", "RunResult", "resume", "run"]  # _HOMES' keys


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'ringleader' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
