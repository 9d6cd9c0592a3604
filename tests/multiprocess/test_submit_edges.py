"""``ringleader submit | status | logs | stop`` at their edges, without a cluster: what a
submission shows and uploads (no override value in the entrypoint or metadata, no token file in
the package), the user's own modules on validation, and a job server that never answers."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from orchestrator.commands.submit import Cluster, SubmissionError
from ringleader.cli import main
from tests.helpers.paths import REPO

SECRET = "s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/ckpt"


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path) -> None:
    """The key that names overrides files (``orchestrator/commands/submit.py``) is made here, not in
    the user's own cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def submitted(monkeypatch, tmp_path) -> list[dict[str, Any]]:
    """``Cluster.submit`` recording what it was given and the package Ray would upload then
    (built by Ray's own packaging from the runtime env), instead of sending it."""
    from ray._private.runtime_env.packaging import create_package

    monkeypatch.setattr(sys, "path", list(sys.path))  # submit puts the working directory on it
    calls: list[dict[str, Any]] = []

    def submit(self: Cluster, entrypoint: str, runtime_env: dict[str, Any], metadata: dict[str, str]) -> str:
        package = tmp_path / f"package-{len(calls)}.zip"
        create_package(runtime_env["working_dir"], package, include_gitignore=True, excludes=runtime_env["excludes"])
        with zipfile.ZipFile(package) as archive:
            files = {name: archive.read(name).decode(errors="replace") for name in archive.namelist() if not name.endswith("/")}
        calls.append({"entrypoint": entrypoint, "runtime_env": runtime_env, "metadata": metadata, "files": files})
        return "raysubmit_test"

    monkeypatch.setattr(Cluster, "submit", submit)
    return calls


def _project(directory: Path, module: str | None = None) -> Path:
    directory.mkdir(parents=True)
    job = {"name": "edge", "steps": 2, "eval": None}
    if module:
        (directory / f"{module}.py").write_text(
            "from ringleader_examples.digits import make_model as _make\n\ndef make_model(hidden=8):\n    return _make(hidden)\n"
        )
        job["model"] = {"factory": f"{module}:make_model"}
    (directory / "job.yaml").write_text(json.dumps(job))
    return directory


def test_no_override_value_is_in_the_entrypoint_or_metadata_and_no_token_in_the_package(tmp_path, submitted, capsys):
    project = _project(tmp_path / "project")
    (project / "secrets").mkdir()
    token = project / "secrets" / "auth token"
    token.write_text("the-cluster-token\n")
    code = main([
        "submit", str(project / "job.yaml"), "--working-dir", str(project), "--address", "http://127.0.0.1:1",
        "--token-file", str(token), "--set", f"checkpoint.path={SECRET}", "--set", "steps=3",
    ])
    assert code == 0, capsys.readouterr().err
    (call,) = submitted
    shown = json.dumps([call["entrypoint"], call["metadata"], call["runtime_env"]])
    assert "AKIAEXAMPLE" not in shown and "wJalrXUtnFEMI" not in shown and "steps=3" not in shown
    # The overrides travel in the package, in the file the entrypoint names...
    named = call["entrypoint"].split("--set-file ")[1].split()[0]
    assert json.loads(call["files"][named]) == [f"checkpoint.path={SECRET}", "steps=3"]
    # ...which is gone from the working directory once submitted; the token never travels.
    assert not list(project.glob(".ringleader-submit-*"))
    assert "secrets/auth token" not in call["files"] and "job.yaml" in call["files"]
    assert all("the-cluster-token" not in text for text in call["files"].values())


def test_the_shipped_overrides_are_what_run_applies(tmp_path, capsys):
    from orchestrator.job.reading import encode_overrides

    (tmp_path / "overrides.json").write_bytes(encode_overrides(["steps=0"]))
    assert main(["run", "--set-file", str(tmp_path / "overrides.json"), "--run-dir", str(tmp_path / "run")]) == 2
    assert "field 'steps'" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text('{"steps": 1}')
    assert main(["run", "--set-file", str(tmp_path / "broken.json")]) == 2
    assert f"--set-file {tmp_path / 'broken.json'} is not a JSON list of FIELD=VALUE strings" in capsys.readouterr().err


def test_an_overrides_file_the_working_directory_ignores_is_refused_before_submitting(tmp_path, submitted, capsys):
    project = _project(tmp_path / "project")
    (project / ".gitignore").write_text(".*\n")
    assert main(["submit", str(project / "job.yaml"), "--working-dir", str(project), "--set", "steps=3"]) == 2
    assert "!.ringleader-submit-*.json" in capsys.readouterr().err
    assert not submitted and not list(project.glob(".ringleader-submit-*"))


def test_submit_validates_with_the_working_directory_importable(tmp_path, submitted, capsys, monkeypatch):
    """The job names a module that exists only in the working directory; submitting from
    elsewhere (as the cluster will run it there) must find it."""
    project = _project(tmp_path / "project", module="edge_only_models")
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "project/job.yaml", "--working-dir", "project", "--address", "http://127.0.0.1:1"]) == 0, (
        capsys.readouterr().err
    )
    assert submitted[0]["metadata"] == {"ringleader_job": "edge"}
    assert "edge_only_models.py" in submitted[0]["files"]
    assert project.is_dir()


def _submit(project: Path, *overrides: str) -> int:
    sets = [arg for item in overrides for arg in ("--set", item)]
    return main(["submit", str(project / "job.yaml"), "--working-dir", str(project), "--address", "http://127.0.0.1:1", *sets])


def test_the_same_overrides_ship_the_same_file_so_the_same_package(tmp_path, submitted, capsys):
    project = _project(tmp_path / "project")
    assert _submit(project, "steps=3") == 0 and _submit(project, "steps=3") == 0 and _submit(project, "steps=4") == 0
    first, again, other = (call["entrypoint"] for call in submitted)
    assert first == again and first != other
    assert submitted[0]["files"] == submitted[1]["files"]  # what Ray hashes into the package's name


def test_the_overrides_file_name_confirms_no_guess_of_them(tmp_path, submitted, capsys, monkeypatch):
    """The name shows in the entrypoint: a plain hash of the overrides would let whoever sees
    it confirm a guessed credential offline. It is keyed by a secret of this user's, made once
    (0600) and kept: the same overrides still ship the same file; under another key, another."""
    import hashlib

    from orchestrator.job.reading import encode_overrides

    project = _project(tmp_path / "project")
    overrides = [f"checkpoint.path={SECRET}"]
    assert _submit(project, *overrides) == 0 and _submit(project, *overrides) == 0, capsys.readouterr().err
    first, again = (call["entrypoint"].split("--set-file ")[1].split()[0] for call in submitted)
    assert first == again
    assert hashlib.sha256(encode_overrides(overrides)).hexdigest()[:16] not in first
    key = tmp_path / "cache" / "ringleader" / "submit-overrides.key"
    assert key.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "another-user"))
    assert _submit(project, *overrides) == 0
    assert submitted[2]["entrypoint"].split("--set-file ")[1].split()[0] != first


def test_a_killed_submits_overrides_file_is_removed_and_a_live_ones_never_shipped(tmp_path, submitted, capsys, monkeypatch):
    """A SIGKILLed submit leaves its file, holding a credential: nobody holds it, so the next
    submit removes it. A concurrent submit's (held: a live one) stays, out of this upload."""
    import fcntl

    project = _project(tmp_path / "project")
    stale, live = project / ".ringleader-submit-0123456789abcdef.json", project / ".ringleader-submit-fedcba9876543210.json"
    for path in (stale, live):
        path.write_text(json.dumps([f"checkpoint.path={SECRET}"]))
    with open(live) as holder:
        fcntl.flock(holder, fcntl.LOCK_SH)  # as the live submit does
        assert _submit(project, "steps=3") == 0, capsys.readouterr().err
        (call,) = submitted
        assert not stale.exists() and live.exists()
        assert all("AKIAEXAMPLE" not in text for text in call["files"].values())
        shipped = call["entrypoint"].split("--set-file ")[1].split()[0]
        assert [name for name in call["files"] if "ringleader-submit" in name] == [shipped]

        def refused(*args: Any) -> str:
            raise SubmissionError("the cluster refused it")

        monkeypatch.setattr(Cluster, "submit", refused)
        assert _submit(project, "steps=3") == 2  # a failed submit removes its file too
        assert [path.name for path in project.glob(".ringleader-submit-*")] == [live.name]


def test_submits_of_the_same_overrides_share_one_file_the_last_one_out_removes(tmp_path):
    from orchestrator.commands.held_files import held_file

    path = tmp_path / "shared.json"
    with held_file(path, b"[]"):
        with held_file(path, b"[]"):
            assert path.read_bytes() == b"[]"
        assert path.exists()  # the first submit still uploads it
    assert not path.exists()


def test_the_last_two_out_at_the_same_instant_still_remove_the_file(tmp_path, monkeypatch):
    """Another holder (another submit of the same overrides) leaves just as this one tries to
    remove the file: refused once, this one tries again, and removes it."""
    import fcntl

    from orchestrator.commands import held_files

    path = tmp_path / "shared.json"
    other: list[int] = []
    lock = held_files._lock

    def leaving_at_once(fd: int, how: int) -> bool:
        granted = lock(fd, how)
        if how == fcntl.LOCK_EX and not granted and other:
            os.close(other.pop())  # the other holder is gone a moment after this one's first try
        return granted

    monkeypatch.setattr(held_files, "_lock", leaving_at_once)
    with held_files.held_file(path, b"[]"):
        other.append(os.open(path, os.O_RDONLY))
        fcntl.flock(other[0], fcntl.LOCK_SH)  # as its holder does
    assert not other  # it did leave during the removal
    assert not path.exists()


def test_a_read_only_working_directory_is_one_line_saying_what_to_do(tmp_path, submitted, capsys, monkeypatch):
    import errno
    import tempfile

    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    project = _project(tmp_path / "project")
    monkeypatch.setattr(tempfile, "mkstemp", read_only)  # root writes through a chmod: a read-only mount, as it answers
    assert _submit(project, "steps=3") == 2
    err = capsys.readouterr().err
    assert err == (
        f"ringleader: cannot write the --set values into the working directory {project} (Read-only file system), "
        "with which they travel: submit from a writable directory (--working-dir), or put them in the job file\n"
    )
    assert not submitted


@contextlib.contextmanager
def _silent_server() -> Iterator[int]:
    """A TCP server on a free port that accepts every connection and never answers."""
    held: list[socket.socket] = []
    stop = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        for connection in held:
            connection.close()
        server.close()


@pytest.mark.parametrize(
    "command",
    [["status", "raysubmit_x"], ["logs", "raysubmit_x"], ["logs", "raysubmit_x", "--follow"], ["stop", "raysubmit_x"],
     ["submit", "job.yaml"]],
    ids=lambda command: " ".join(command[::2]),
)
def test_a_job_server_that_never_answers_ends_in_one_line(tmp_path, command):
    _project(tmp_path / "project")
    with _silent_server() as port:
        address = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "ringleader", *command, "--address", address, "--timeout", "1"],
            cwd=tmp_path / "project", env={**_clean_env(), "PYTHONPATH": str(REPO)},
            capture_output=True, text=True, timeout=60,
        )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"ringleader: the Ray job server at {address} did not answer within 1s (is the head up, and is that its dashboard port?)"
    )
    assert time.monotonic() - started < 30


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}


class _VersionOnly(http.server.BaseHTTPRequestHandler):
    """Answers Ray's version check, then never answers anything else (the log stream's upgrade)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/api/version":
            import ray

            body = json.dumps({"version": "4", "ray_version": ray.__version__, "ray_commit": "x"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.server.release.wait(30)  # type: ignore[attr-defined]

    def log_message(self, *args: Any) -> None:
        pass


def test_following_a_log_stream_that_never_opens_ends_in_one_line(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _VersionOnly)
    server.release = threading.Event()  # type: ignore[attr-defined]
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(SubmissionError, match=f"^the Ray job server at {address} did not answer within 1s"):
            Cluster(address, None, timeout_s=1).follow("raysubmit_x", lambda text: None)
    finally:
        server.release.set()  # type: ignore[attr-defined]
        server.shutdown()
        server.server_close()


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, its own CA, and its key: (cert, key) files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ringleader test head")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(__import__("ipaddress").ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "head.pem", directory / "head.key"
    pem = serialization.Encoding.PEM
    cert_file.write_bytes(cert.public_bytes(pem))
    key_file.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_file, key_file


@contextlib.contextmanager
def _job_server(tls: tuple[Path, Path] | None, cookie: str | None, header: str | None) -> Iterator[str]:
    """A job server (aiohttp, as Ray's) that answers the version check, and streams one log line
    to a log-tail request that carries the ``cookie`` and ``header`` it asks for (else 401);
    over TLS with ``tls``'s certificate. Yields its address."""
    import asyncio
    import ssl

    import ray
    from aiohttp import web

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "4", "ray_version": ray.__version__, "ray_commit": "x"})

    async def tail(request: web.Request) -> web.StreamResponse:
        if (cookie and request.cookies.get("session") != cookie) or (header and request.headers.get("X-Proxy-Auth") != header):
            return web.Response(status=401)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str("the job's line\n")
        await ws.close()
        return ws

    app = web.Application()
    app.add_routes([web.get("/api/version", version), web.get("/api/jobs/{id}/logs/tail", tail)])
    context = None
    if tls:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*tls)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@pytest.mark.parametrize("needs", ["custom CA", "cookie", "header"])
def test_following_logs_speaks_as_the_client_does(tmp_path, monkeypatch, needs):
    """The log stream carries what the client carries: its TLS verification (a custom CA),
    cookies and headers (a cluster plugin's, the token Ray found itself)."""
    from orchestrator.commands.submit import _bounded_client

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.setattr(Cluster, "status", lambda self, submission_id: ("SUCCEEDED", ""))
    tls = _self_signed(tmp_path) if needs == "custom CA" else None
    cookie = "abc" if needs == "cookie" else None
    header = "p" if needs == "header" else None
    with _job_server(tls, cookie, header) as address:
        cluster = Cluster(address, None, timeout_s=5)
        cluster._client = _bounded_client(5)(
            address, cookies={"session": cookie} if cookie else None, headers={"X-Proxy-Auth": header} if header else None,
            verify=str(tls[0]) if tls else True,
        )
        lines: list[str] = []
        assert cluster.follow("raysubmit_x", lines.append) == "SUCCEEDED"
    assert lines == ["the job's line\n"]
