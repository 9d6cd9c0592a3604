"""The job's TCPStore server in a child process of the driver (docs/architecture.md, "The
control plane at scale").

Every worker's shard claims (two round trips per worker per step, more while stealing or
rescuing) and every rendezvous go through the store; served by a thread of the driver, that
traffic took most of the driver's CPU at 32 workers and more. In a process of its own it runs
on its own core and never holds the GIL the driver's loop needs. The child binds the listening
socket to the given address only (as the in-process server does), prints its port, and exits
when the driver goes away (it watches its parent) or is stopped by PID (``close``).

Run as ``python -m orchestrator.store.server_process HOST TIMEOUT_S PARENT_PID``.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch.distributed as dist

from orchestrator.errors import StoreFailed

# How long the child may take to import torch and listen before the driver gives up.
START_TIMEOUT_S = 60.0
# How often the child checks that the driver that started it is still there.
PARENT_POLL_S = 0.5


class StoreProcessError(StoreFailed):
    """The store's child process did not start or died."""


class StoreProcess:
    """Starts the server process at once (it imports torch, which takes a second or two, while
    the workers start); ``port`` waits for it to listen (up to ``START_TIMEOUT_S``, then
    StoreProcessError). ``role``: what the store is for, as its errors name it."""

    def __init__(self, host: str, timeout_s: float, role: str = "rendezvous store") -> None:
        self.host = host
        self.role = role
        # Its log goes to a file: a pipe nobody reads would fill and block the server.
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.store.server_process", host, str(timeout_s), str(os.getpid())],
            stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            # Its own session: a Ctrl-C at the terminal stops the driver, which then stops it
            # after the job's teardown (that still reads the store); it watches the driver too.
            start_new_session=True,
        )
        self._port: int | None = None

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def known_port(self) -> int | None:
        """The port, once the process has said it listens (no wait)."""
        return self._port

    @property
    def port(self) -> int:
        if self._port is None:
            self._port = self._read_port()
        return self._port

    def _read_port(self) -> int:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], START_TIMEOUT_S)
        line = self._proc.stdout.readline() if ready else ""
        if not line.strip().isdigit():
            self.close()
            raise StoreProcessError(
                f"the {self.role}'s process did not start listening on {self.host} within "
                f"{START_TIMEOUT_S:.0f}s: {line.strip() or self.last_words() or 'no output'}"
            )
        return int(line)

    def last_words(self) -> str:
        """The end of what the process wrote to stderr (its error, if it failed), up to 500
        characters; empty if nothing (or once closed)."""
        if self._stderr.closed:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().strip()[-500:]

    def exit_status(self) -> int | None:
        """The process's exit status if it has ended (it should live as long as the job)."""
        return self._proc.poll()

    def cpu_s(self) -> float | None:
        """CPU seconds (user and system) the server process has used so far, from
        ``/proc/PID/stat``; None where there is no /proc (not Linux) or it is gone."""
        try:
            with open(f"/proc/{self._proc.pid}/stat") as stat:
                # Fields after the command (which may hold spaces): utime and stime are 14 and 15.
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        """Stop the server process (by its PID) and reap it."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5.0)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._stderr.close()


def listening_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """A TCPStore server listening on ``host`` only (an ephemeral port), and its port."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    # Bound here and handed to the store: TCPStore alone would listen on every interface.
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(1024)
    port = listener.getsockname()[1]
    server = dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
        # The store owns the descriptor from here on (and closes it): detach it from the
        # Python socket, or both would close the same number.
        master_listen_fd=listener.detach(),
    )
    return server, port


def _serve(host: str, timeout_s: float, parent: int) -> None:
    store, port = listening_store(host, timeout_s)
    print(port, flush=True)
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    del store


if __name__ == "__main__":
    _serve(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
