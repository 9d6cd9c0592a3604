"""A user's loss tried before Ray starts, in a child process killed at the launch's deadline.

``check_loss`` (``orchestrator/job/reading.py``) runs the job's dataset factory, which may
download or tokenise for minutes. On a thread of the driver it would go on past its budget:
downloading into the directory the local workers then download into at the same time, and
holding the dataset in the driver's memory for the whole run. Here it runs in a child process
of its own session, killed with whatever it started when its budget is spent.

The parent starts the child at once (``LossTrial``), so its imports (torch: seconds) overlap
the driver's own, and hands it the job, cloudpickled (the Python API's callables included),
once the driver has checked the job's imports (``settle``). The child (``python -m
orchestrator.job.loss_check``) writes its one answer, a refusal or nothing, on its stdout; what the
user's code prints goes nowhere (the workers run it again, and say what fails). POSIX only.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
from types import TracebackType

from jobspec.fields import ConfigError
from jobspec.job import JobConfig
from jobspec.recipe import BUILTIN_LOSSES

#: How long a killed child (and whatever it started) is given to be gone before it is left.
REAP_S = 5.0


class LossTrial:
    """``check_loss`` for ``job`` in a child process, started on entry (none for a built-in
    loss: those keep the contract, and cost nothing) and killed, with its process group, on
    exit, whatever happened (the interpreter's exit included)."""

    def __init__(self, job: JobConfig, source: str) -> None:
        self._job, self._source = job, source
        self._child: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LossTrial:
        if self._job.loss.name in BUILTIN_LOSSES:
            return self
        # The driver's import path as it is now: the job's modules are wherever it found them.
        path = os.pathsep.join(os.path.abspath(entry) for entry in sys.path)
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path}, start_new_session=True,
            )
        except OSError:  # no interpreter to start (an embedded one): the workers check it
            return self
        atexit.register(self.close)
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, trace: TracebackType | None) -> None:
        self.close()

    def settle(self, budget_s: float) -> None:
        """Hand the child the job and wait at most ``budget_s`` for its answer. Raises
        ConfigError naming ``loss`` if the loss returned a scalar; returns if it passed, if
        anything on the way failed (left to the workers, which report it), or at the deadline,
        the child killed then."""
        if self._child is None:
            return
        from ray import cloudpickle  # ray's own copy: Ray pickles the job the same way for the workers

        try:
            payload = cloudpickle.dumps((self._job, self._source))
            answer, _ = self._child.communicate(payload, timeout=budget_s)
        except subprocess.TimeoutExpired:
            return
        except Exception:  # noqa: BLE001 - a job that cannot be pickled (Ray says so as it starts the workers)
            return
        finally:
            self.close()
        with contextlib.suppress(ValueError):
            refused = json.loads(answer).get("refused") if answer else None
            if isinstance(refused, str):
                raise ConfigError(refused)

    def close(self) -> None:
        """Kill the child and what it started (its process group), and reap it."""
        child, self._child = self._child, None
        if child is None:
            return
        atexit.unregister(self.close)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # its session's group: a downloader's helpers too
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.communicate(timeout=REAP_S)


def _main() -> None:
    """The child: the imports first (while the driver still checks the job's), then the job
    from stdin, ``check_loss`` on it, and a refusal, if any, as JSON on stdout."""
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the user's prints go nowhere: this stream is the answer's
    import pickle

    import torch  # noqa: F401 - the bulk of the wait, before the job arrives

    import workers.model.flat_parameters  # noqa: F401
    import workers.model.objective  # noqa: F401 - what check_loss imports
    from orchestrator.job.reading import check_loss

    payload = sys.stdin.buffer.read()
    if not payload:  # the driver went on without the check
        return
    job, source = pickle.loads(payload)  # a module the child cannot import fails here: left to the workers
    try:
        check_loss(job, source)
    except ConfigError as err:
        answer.write(json.dumps({"refused": str(err)}))
    answer.close()


if __name__ == "__main__":
    _main()
