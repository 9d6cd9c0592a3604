"""Jobs on a Ray cluster's job server: ``ringleader submit | status | logs | stop``.

``submit`` validates the job here (a bad field fails before anything is uploaded), then asks
Ray's ``JobSubmissionClient`` to run ``python -m ringleader run JOB ...`` on the cluster
with a runtime env: the working directory (where the job file and the user's factories are)
and ringleader's own packages as ``py_modules``, so the cluster runs this version of the code.
Every argument of the entrypoint is shell-quoted: Ray runs it through a shell.

Ray 2.60 protects the job server with a token when the cluster was started with token
authentication. The token is taken from ``--token-file``, else where Ray itself looks:
``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``. A missing or refused token,
or a server that cannot be reached, is a one-line ``SubmissionError``.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
#: ringleader's packages, shipped with every submission (the cluster runs this code).
PACKAGES = ("jobspec", "orchestrator", "workers", "policies", "ringleader", "ringleader_examples")
#: Never uploaded from the working directory.
EXCLUDES = [".git", ".venv", "venv", "runs", "__pycache__", "*.pyc", ".pytest_cache"]
#: How long a submission waits for a just-started head's job agent.
AGENT_WAIT_S = 60.0
#: After a log stream ends, how long to wait for the job's final status.
SETTLE_S = 30.0
EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 130}


class SubmissionError(Exception):
    """A submission problem for the user, as one line."""


@dataclass(frozen=True)
class Token:
    """A cluster token and where it came from (for messages; never the token itself)."""

    value: str = field(repr=False)
    source: str


def find_token(token_file: Path | None) -> Token | None:
    """The token to send: ``token_file``, else ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``,
    ``~/.ray/auth_token`` (Ray's own order); None if there is none. Raises SubmissionError if
    a named token file cannot be read or is empty."""
    if token_file is not None:
        return _read_token(token_file, f"--token-file {token_file}")
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return Token(os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN")
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        path = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
        return _read_token(path, f"RAY_AUTH_TOKEN_PATH ({path})")
    default = Path.home() / ".ray" / "auth_token"
    return _read_token(default, str(default)) if default.is_file() else None


def _read_token(path: Path, source: str) -> Token:
    try:
        value = path.read_text().strip()
    except OSError as err:
        raise SubmissionError(f"cannot read the token from {source}: {err.strerror}") from None
    if not value:
        raise SubmissionError(f"the token file of {source} is empty")
    return Token(value, source)


class Cluster:
    """A job server at ``address`` (``http://HEAD:8265``), with the token, if any."""

    def __init__(self, address: str | None, token_file: Path | None = None) -> None:
        self.explicit = address is not None
        self.address = address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS
        self.token = find_token(token_file)
        self._client: JobSubmissionClient | None = None

    @contextmanager
    def _speaking(self) -> Iterator[None]:
        """Turn the job server's and the network's errors into one-line SubmissionErrors."""
        from ray.exceptions import AuthenticationError

        try:
            yield
        except AuthenticationError as err:
            if "401" in str(err) or "required" in _first_line(err).lower():
                raise SubmissionError(
                    f"the Ray cluster at {self.address} requires a token and none was found: pass "
                    "--token-file, set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, or put it in ~/.ray/auth_token"
                ) from None
            source = self.token.source if self.token else "Ray's defaults"
            raise SubmissionError(f"the Ray cluster at {self.address} refused the token from {source}") from None
        except (ConnectionError, OSError) as err:  # requests' errors are OSErrors too
            raise SubmissionError(f"cannot reach the Ray job server at {self.address}: {_first_line(err)}") from None
        except (RuntimeError, ValueError) as err:  # the server's answer to a bad request; a package too large
            raise SubmissionError(_first_line(err)) from None
        except Exception as err:
            import aiohttp  # the log stream's client (a 404 on the upgrade, a dropped connection)

            if isinstance(err, aiohttp.ClientError):
                raise SubmissionError(f"the job server at {self.address} refused the log stream: {_first_line(err)}") from None
            raise

    @property
    def client(self) -> JobSubmissionClient:
        if self._client is None:
            from ray.job_submission import JobSubmissionClient

            headers = {"Authorization": f"Bearer {self.token.value}"} if self.token else {}
            # Ray lets RAY_API_SERVER_ADDRESS or RAY_ADDRESS override the address it is given:
            # one given on the command line must win (and get this cluster's token).
            saved = os.environ.get("RAY_API_SERVER_ADDRESS")
            if self.explicit:
                os.environ["RAY_API_SERVER_ADDRESS"] = self.address
            try:
                with self._speaking():
                    self._client = JobSubmissionClient(self.address, headers=headers)
            finally:
                if self.explicit:
                    if saved is None:
                        os.environ.pop("RAY_API_SERVER_ADDRESS", None)
                    else:
                        os.environ["RAY_API_SERVER_ADDRESS"] = saved
        return self._client

    def submit(self, entrypoint: str, runtime_env: dict[str, Any], metadata: dict[str, str]) -> str:
        """Submit; returns the submission id. A head that has just started answers "no
        available agent" until its job agent is up: that is retried for ``AGENT_WAIT_S``."""
        deadline = time.monotonic() + AGENT_WAIT_S
        while True:
            try:
                with self._speaking():
                    return self.client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, metadata=metadata)
            except SubmissionError as err:
                if "no available agent" not in str(err).lower() or time.monotonic() > deadline:
                    raise
            time.sleep(1.0)

    def status(self, submission_id: str) -> tuple[str, str]:
        """The job's status (``PENDING``, ``RUNNING``, ``SUCCEEDED``, ``FAILED``, ``STOPPED``)
        and the job server's message about it."""
        with self._speaking():
            info = self.client.get_job_info(submission_id)
        return str(info.status.value), info.message or ""

    def logs(self, submission_id: str) -> str:
        with self._speaking():
            return self.client.get_job_logs(submission_id)

    def stop(self, submission_id: str) -> bool:
        with self._speaking():
            return self.client.stop_job(submission_id)

    def follow(self, submission_id: str, write: Callable[[str], None]) -> str:
        """Stream the job's logs to ``write`` until it ends; returns its final status. If the
        stream ends while the job is still running (the connection dropped), waits up to
        ``SETTLE_S`` for it to end, then raises SubmissionError saying how to follow again."""

        async def stream() -> None:
            async for lines in self.client.tail_job_logs(submission_id):
                write(lines)

        with self._speaking():
            asyncio.run(stream())
        deadline = time.monotonic() + SETTLE_S
        while True:
            status, _ = self.status(submission_id)
            if status in EXIT_CODES:
                return status
            if time.monotonic() > deadline:
                raise SubmissionError(
                    f"the log stream of {submission_id} ended while it is {status}; "
                    f"follow it again with: ringleader logs --follow {submission_id}"
                )
            time.sleep(1.0)


def job_entrypoint(job_file: str, overrides: list[str], run_dir: str | None) -> str:
    """The command the cluster runs, each argument quoted for the shell Ray runs it in."""
    argv = ["python", "-m", "ringleader", "run", job_file, "--no-progress"]
    for override in overrides:
        argv += ["--set", override]
    if run_dir is not None:
        argv += ["--run-dir", run_dir]
    return shlex.join(argv)


def runtime_env(working_dir: Path) -> dict[str, Any]:
    """The working directory, and ringleader's packages that are not inside it."""
    shipped = []
    for name in PACKAGES:
        package = Path(sys.modules[name].__file__ or "").parent if name in sys.modules else _package_dir(name)
        if not package.resolve().is_relative_to(working_dir.resolve()):
            shipped.append(str(package))
    env: dict[str, Any] = {"working_dir": str(working_dir), "excludes": list(EXCLUDES)}
    if shipped:
        env["py_modules"] = shipped
    return env


def _package_dir(name: str) -> Path:
    import importlib

    return Path(importlib.import_module(name).__file__ or "").parent


def job_path_within(job_file: Path, working_dir: Path) -> str:
    """``job_file`` relative to ``working_dir`` (with which it travels). Raises
    SubmissionError if it is not inside it or does not exist."""
    if not job_file.is_file():
        raise SubmissionError(f"job file {job_file} does not exist")
    try:
        return str(job_file.resolve().relative_to(working_dir.resolve()))
    except ValueError:
        raise SubmissionError(
            f"job file {job_file} is not inside the working directory {working_dir}, which is what travels "
            "to the cluster: run from a directory that holds it, or pass --working-dir"
        ) from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
