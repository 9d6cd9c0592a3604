"""Jobs on a Ray cluster's job server: ``ringleader submit | status | logs | stop``.

``submit`` validates the job here (a bad field fails before anything is uploaded), then asks
Ray's ``JobSubmissionClient`` to run ``python -m ringleader run JOB ...`` on the cluster
with a runtime env: the working directory (where the job file and the user's factories are)
and ringleader's own packages as ``py_modules``, so the cluster runs this version of the code.
Every argument of the entrypoint is shell-quoted: Ray runs it through a shell.

The ``--set`` overrides travel in a file written into the working directory for the upload
(``shipped_overrides``), never in the entrypoint or the metadata: ``ray job list``, the
dashboard, the job's info and ``ps`` on the head all show those, and an override may hold a
credential (``checkpoint.path=s3://KEY:SECRET@...``). Its name is an HMAC of its content under
a key of this user's (``overrides_key``): the same overrides, the same package (Ray's cache
hits), and a name that confirms no guess of them; no other submit's such file is ever
uploaded, and those no live submit holds (a killed one's) are removed. The token file, when it
sits inside the working directory, is excluded from the upload.

Every request to the job server has a timeout (``REQUEST_TIMEOUT_S``, ``--timeout``): a head
that accepts connections and never answers ends in one line naming its address, not a hang;
a followed log stream is pinged as often, so a head that stops answering ends it too.

Ray 2.60 protects the job server with a token when the cluster was started with token
authentication. The token is taken from ``--token-file``, else where Ray itself looks:
``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``. A missing or refused token,
or a server that cannot be reached, is a one-line ``SubmissionError``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import shlex
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobspec.durable import write_atomic
from jobspec.fields import first_line
from orchestrator.commands.held_files import held_file, remove_unheld
from orchestrator.job.reading import encode_overrides

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
#: How long any request waits for the job server's answer (each read, not the whole
#: transfer: a large upload that keeps moving is not cut off), and how often a followed log
#: stream pings it.
REQUEST_TIMEOUT_S = 30.0
#: The overrides file ``submit`` writes into the working directory: ``<prefix><content hash>.json``.
OVERRIDES_PREFIX = ".ringleader-submit-"
#: The length of the key that names overrides files (``overrides_key``): as long as the SHA-256 it keys.
OVERRIDES_KEY_BYTES = 32
EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 130}


class SubmissionError(Exception):
    """A submission problem for the user, as one line."""


@dataclass(frozen=True)
class Token:
    """A cluster token and where it came from (for messages; never the token itself), and
    the file it was read from (None: from ``RAY_AUTH_TOKEN``), kept out of any upload."""

    value: str = field(repr=False)
    source: str
    path: Path | None = None


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
    return Token(value, source, path)


class Cluster:
    """A job server at ``address`` (``http://HEAD:8265``), with the token, if any; each
    request waits at most ``timeout_s`` for its answer (``SubmissionError`` after that)."""

    def __init__(self, address: str | None, token_file: Path | None = None, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.explicit = address is not None
        self.address = address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS
        self.token = find_token(token_file)
        self.timeout_s = timeout_s
        self._client: JobSubmissionClient | None = None

    @contextmanager
    def _speaking(self) -> Iterator[None]:
        """Turn the job server's and the network's errors into one-line SubmissionErrors."""
        import requests
        from ray.exceptions import AuthenticationError

        try:
            yield
        except (requests.exceptions.Timeout, asyncio.TimeoutError):
            # Before OSError: requests' timeouts are OSErrors, aiohttp's a TimeoutError.
            raise SubmissionError(
                f"the Ray job server at {self.address} did not answer within {self.timeout_s:g}s "
                "(is the head up, and is that its dashboard port?)"
            ) from None
        except AuthenticationError as err:
            if "401" in str(err) or "required" in first_line(err).lower():
                raise SubmissionError(
                    f"the Ray cluster at {self.address} requires a token and none was found: pass "
                    "--token-file, set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, or put it in ~/.ray/auth_token"
                ) from None
            source = self.token.source if self.token else "Ray's defaults"
            raise SubmissionError(f"the Ray cluster at {self.address} refused the token from {source}") from None
        except (ConnectionError, OSError) as err:  # requests' errors are OSErrors too
            raise SubmissionError(f"cannot reach the Ray job server at {self.address}: {first_line(err)}") from None
        except (RuntimeError, ValueError) as err:  # the server's answer to a bad request; a package too large
            raise SubmissionError(first_line(err)) from None
        except Exception as err:
            import aiohttp  # the log stream's client (a 404 on the upgrade, a dropped connection)

            if isinstance(err, aiohttp.ClientError):
                raise SubmissionError(f"the job server at {self.address} refused the log stream: {first_line(err)}") from None
            raise

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token.value}"} if self.token else {}

    @property
    def client(self) -> JobSubmissionClient:
        if self._client is None:
            headers = self.headers
            # Ray lets RAY_API_SERVER_ADDRESS or RAY_ADDRESS override the address it is given:
            # one given on the command line must win (and get this cluster's token).
            saved = os.environ.get("RAY_API_SERVER_ADDRESS")
            if self.explicit:
                os.environ["RAY_API_SERVER_ADDRESS"] = self.address
            try:
                with self._speaking():
                    self._client = _bounded_client(self.timeout_s)(self.address, headers=headers)
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
            async for lines in self._tail(submission_id):
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

    async def _tail(self, submission_id: str) -> AsyncIterator[str]:
        """The job's log lines as the job server streams them (what Ray's ``tail_job_logs``
        does, with bounds it has not): the upgrade must answer within ``timeout_s``, and the
        stream is pinged every ``timeout_s``, so a server that stops answering ends it
        (a quiet job does not: its server still answers the pings). It speaks as the client
        does: the client's headers (ours, and those Ray added: its token, a cluster plugin's),
        cookies and TLS settings (verification, a custom CA)."""
        import aiohttp

        client = self.client
        url = f"{client.get_address()}/api/jobs/{submission_id}/logs/tail"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s)
        # Ray's own tail_job_logs reads the same attributes; None: aiohttp's default verification.
        tls = True if client._ssl_context is None else client._ssl_context
        async with aiohttp.ClientSession(headers=client._headers, cookies=client._cookies, timeout=timeout) as session:
            async with session.ws_connect(url, heartbeat=self.timeout_s, ssl=tls) as ws:
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.TEXT:
                        yield message.data
                    elif message.type == aiohttp.WSMsgType.ERROR:
                        raise ws.exception() or aiohttp.ClientError("log stream error")
                if isinstance(ws.exception(), asyncio.TimeoutError):  # the pings went unanswered
                    raise asyncio.TimeoutError
                if ws.close_code == aiohttp.WSCloseCode.ABNORMAL_CLOSURE:
                    raise aiohttp.ClientError(f"the log stream closed abnormally ({ws.close_code})")


def _bounded_client(timeout_s: float) -> type[JobSubmissionClient]:
    """Ray's ``JobSubmissionClient`` whose every request (its constructor's version check
    included) times out after ``timeout_s`` without an answer; Ray's own sends none."""
    from ray.job_submission import JobSubmissionClient

    class BoundedClient(JobSubmissionClient):
        def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", timeout_s)
            return super()._do_request(method, endpoint, **kwargs)

    return BoundedClient


def job_entrypoint(job_file: str, overrides_file: str | None, run_dir: str | None) -> str:
    """The command the cluster runs, each argument quoted for the shell Ray runs it in. The
    overrides come in ``overrides_file`` (see ``shipped_overrides``), never as values."""
    argv = ["python", "-m", "ringleader", "run", job_file, "--no-progress"]
    if overrides_file is not None:
        argv += ["--set-file", overrides_file]
    if run_dir is not None:
        argv += ["--run-dir", run_dir]
    return shlex.join(argv)


@contextmanager
def shipped_overrides(working_dir: Path, overrides: list[str]) -> Iterator[str | None]:
    """Write ``overrides`` into ``working_dir`` for the upload, in a file private to its owner
    and named by their HMAC under ``overrides_key`` (the same overrides package the same
    directory, which Ray's package cache then finds); yields its name there (None without overrides). On exit, failure
    included, the file is removed, unless a concurrent submit of the same overrides still holds
    it (``orchestrator/commands/held_files.py``: the last one out removes it).

    Such files no live submit holds, a killed one's, are removed first: cleaned rather than
    refused, as nobody will read them and each holds a credential perhaps; those a live
    submit holds are left to it, and out of this upload (``runtime_env``). Raises
    SubmissionError if the directory cannot be written (read-only) or its ``.gitignore`` or
    ``.rayignore`` would leave the file out of the upload."""
    if not overrides:
        yield None
        return
    content = encode_overrides(overrides)
    name = f"{OVERRIDES_PREFIX}{hmac.new(overrides_key(), content, hashlib.sha256).hexdigest()[:16]}.json"
    remove_unheld(working_dir, f"{OVERRIDES_PREFIX}*")
    with ExitStack() as held:
        try:
            path = held.enter_context(held_file(working_dir / name, content))
        except OSError as err:
            raise SubmissionError(
                f"cannot write the --set values into the working directory {working_dir} ({err.strerror or err}), "
                "with which they travel: submit from a writable directory (--working-dir), or put them in the job file"
            ) from None
        if _ignored(working_dir, path):
            raise SubmissionError(
                f"the --set values travel in {OVERRIDES_PREFIX}*.json in the working directory, which its .gitignore "
                f"or .rayignore leaves out of the upload: add the line !{OVERRIDES_PREFIX}*.json to that file"
            )
        yield name


def overrides_key() -> bytes:
    """This user's key for naming overrides files: random, made once (0600) in
    ``$XDG_CACHE_HOME/ringleader`` (else ``~/.cache/ringleader``) and kept, so a name confirms
    no guess of the overrides to anyone without it. Where it cannot be kept (a read-only home),
    one for this process only: no cache hits across submits then, and still no guessing."""
    try:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ringleader"
        path = cache / "submit-overrides.key"
        with suppress(FileNotFoundError):
            if len(key := path.read_bytes()) == OVERRIDES_KEY_BYTES:
                return key
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(path, lambda handle: handle.write(os.urandom(OVERRIDES_KEY_BYTES)))  # 0600
        # Read back: of two first submits at once, the one written last is the key kept.
        if len(key := path.read_bytes()) == OVERRIDES_KEY_BYTES:
            return key
    except (OSError, RuntimeError):  # RuntimeError: no home directory to be found
        pass
    return os.urandom(OVERRIDES_KEY_BYTES)


def _ignored(working_dir: Path, path: Path) -> bool:
    """Whether Ray's packaging leaves ``path`` (at the top of ``working_dir``) out: the
    ignore files it reads there (``.gitignore`` unless ``RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1``,
    and ``.rayignore``)."""
    from ray._private.ray_constants import RAY_RUNTIME_ENV_IGNORE_GITIGNORE
    from ray._private.runtime_env.packaging import get_excludes_from_ignore_files

    include_gitignore = os.environ.get(RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"
    return any(match(path) for match in get_excludes_from_ignore_files(working_dir, include_gitignore=include_gitignore))


def runtime_env(working_dir: Path, private: tuple[Path, ...] = (), overrides_file: str | None = None) -> dict[str, Any]:
    """The working directory, and ringleader's packages that are not inside it. ``private``
    files (the token's) that lie inside the working directory are excluded from it, and so is
    every overrides file but ``overrides_file`` (this submit's, from ``shipped_overrides``)."""
    shipped = []
    for name in PACKAGES:
        package = Path(sys.modules[name].__file__ or "").parent if name in sys.modules else _package_dir(name)
        if not package.resolve().is_relative_to(working_dir.resolve()):
            shipped.append(str(package))
    # Another submit's overrides (a concurrent one's, from this directory): never this upload's.
    excludes = [*EXCLUDES, f"/{OVERRIDES_PREFIX}*"]
    if overrides_file is not None:
        excludes.append("!" + _anchored(overrides_file))  # the last matching pattern wins
    for secret in private:
        if secret.resolve().is_relative_to(working_dir.resolve()):
            excludes.append(_anchored(secret.resolve().relative_to(working_dir.resolve()).as_posix()))
    env: dict[str, Any] = {"working_dir": str(working_dir), "excludes": excludes}
    if shipped:
        env["py_modules"] = shipped
    return env


def _anchored(inside: str) -> str:
    """An exclude pattern for the one file ``inside`` the working directory: anchored there,
    glob characters escaped."""
    return "/" + re.sub(r"([][*?\\ ])", r"\\\1", inside)


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
