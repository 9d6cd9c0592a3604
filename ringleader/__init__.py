"""ringleader's Python API: train a job from a script or a notebook, without a job file.

    import ringleader
    result = ringleader.run({"model": {"factory": make_model}, "loss": my_loss, "steps": 100})

See ``ringleader.api`` for the contract, README ("Python API") for a complete example.
"""

from jobspec.fields import ConfigError
from jobspec.job import JobConfig
from ringleader.api import LaunchOptions, RunResult, resume, run

__all__ = ["ConfigError", "JobConfig", "LaunchOptions", "RunResult", "resume", "run"]
