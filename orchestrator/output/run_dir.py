"""The run directory: events, telemetry, final model and summary, written so nothing is torn."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from jobspec.durable import fsync_dir, write_atomic
from jobspec.fields import ConfigError
from jobspec.redaction import redact_all
from jobspec.step_record import StepRecord

if TYPE_CHECKING:
    import torch


JOB_FILE = "job.json"
#: Holds the run's id, the name of its own namespace under the checkpoint root.
RUN_ID_FILE = "run_id"
_RUN_ID = re.compile(r"\d{8}-\d{6}-[0-9a-f]{8}")


def new_run_id() -> str:
    """A fresh run id: UTC time to the second (readable, sorts by start) and 32 random bits
    (unique among runs started in the same second), e.g. ``20261125-030605-9f3a1c2e``."""
    return f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(4)}"


def read_run_id(path: Path) -> str | None:
    """The id recorded in the run directory ``path``; None for a run directory made before run
    ids (no ``run_id`` file: its checkpoints are flat under the root, see
    ``orchestrator/checkpoints/namespace.py``). Raises ConfigError naming the file if it does
    not hold a run id."""
    target = path / RUN_ID_FILE
    try:
        text = target.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{target}: cannot read the run id: {err}") from None
    if not _RUN_ID.fullmatch(text):
        raise ConfigError(f"{target}: expected a run id like 20261125-030605-9f3a1c2e, found {text[:80]!r}")
    return text


class RunListener(Protocol):
    """Told what a run records (``orchestrator/output/tracking.py``'s TrackingListener is one)."""

    def on_event(self, record: dict[str, Any]) -> None: ...
    def on_model(self, path: Path) -> None: ...
    def on_summary(self, summary: dict[str, Any]) -> None: ...


class RunDirectory:
    """Owns one run's folder. Append-only JSONL logs are flushed per record.

    A new run needs a missing or empty folder, and claims it by recording a fresh run id
    there (``new_run_id``) before anything else, in a file only one run can create
    (``_claim``); ``resume`` opens one a run left (its ``job.json`` present), reads its id
    back (``read_run_id``) and appends to its logs. A new run that ends before its job is
    saved is not a run: ``close(discard_unsaved=True)`` leaves its folder as it found it."""

    def __init__(self, path: Path, resume: bool = False) -> None:
        self.path = path
        self.run_id: str | None
        self._new = not resume
        self._made = not path.exists()  # new: it made the folder, else found it empty
        self._saved = False
        if not resume:
            self.ensure_free(path)
            self.run_id = new_run_id()
            self._claim(f"{self.run_id}\n".encode())
        elif not self.is_run(path):
            raise FileNotFoundError(f"{path} is not a run directory (no {JOB_FILE})")
        else:
            self.run_id = read_run_id(path)
        self._lock = threading.Lock()
        self._events = open(path / "events.jsonl", "a", encoding="utf-8")
        self._telemetry = open(path / "telemetry.jsonl", "a", encoding="utf-8")
        self._listeners: list[RunListener] = []

    def subscribe(self, listener: RunListener) -> None:
        """Hand ``listener`` every event recorded from now on, the model and the summary saved
        (as written: credentials masked). Its own problems are its own to report."""
        self._listeners.append(listener)

    @staticmethod
    def ensure_free(path: Path) -> None:
        """Raise FileExistsError unless ``path`` is missing or an empty directory."""
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise FileExistsError(f"run directory {path} is not empty; choose a new --run-dir")

    def _claim(self, text: bytes) -> None:
        """Make the folder this new run's: create ``run_id`` holding ``text`` exclusively
        (``O_EXCL``), durably, before anything else (a job.json without its run id would read
        as a run made before ids). Two runs started in one folder at once (the default run
        directory has one-second resolution) may both find it free; only one creates the file,
        the other raises FileExistsError having written nothing. A torn file (a crash within
        these few bytes) is left only in a folder with no job.json: no resume opens it."""
        target = self.path / RUN_ID_FILE
        for _ in range(3):  # a folder deleted between mkdir and open (another run's discard) is made again
            self.path.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileExistsError:
                raise FileExistsError(f"run directory {self.path} was just taken by another run; choose a new --run-dir") from None
            except FileNotFoundError:
                continue
        else:
            raise FileNotFoundError(f"run directory {self.path} kept vanishing while this run was made in it")
        try:
            os.write(fd, text)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.path)

    @staticmethod
    def is_run(path: Path) -> bool:
        return (path / JOB_FILE).is_file()

    def save_job(self, job: dict[str, Any]) -> Path:
        """The job as run (validated, defaults filled in), so ``ringleader resume`` can rerun it."""
        target = self.path / JOB_FILE
        text = json.dumps(redact_all(job), indent=2, sort_keys=True).encode()
        write_atomic(target, lambda handle: handle.write(text))
        self._saved = True
        return target

    def event(self, kind: str, *, quiet: bool = False, **fields: Any) -> None:
        """Record an event; ``quiet``: not handed to the listeners (their own reports)."""
        record = redact_all({"time": time.time(), "event": kind, **fields})
        with self._lock:  # background threads (chaos adding a node) record events too
            self._events.write(json.dumps(record) + "\n")
            self._events.flush()
        if not quiet:
            for listener in self._listeners:
                listener.on_event(record)

    def telemetry(self, record: StepRecord) -> None:
        """Append the step's line: every rank's figures as columns (``StepRecord.telemetry_line``;
        ``jobspec.step_record.read_telemetry`` gives one dict per rank back). One line a step,
        its columns serialised by orjson straight from the arrays (non-finite floats as null):
        a line per worker cost the driver ~7 us per worker per step, 28 ms a step at 4096."""
        line = orjson.dumps(record.telemetry_line(), option=orjson.OPT_SERIALIZE_NUMPY)
        self._telemetry.write(line.decode() + "\n")
        self._telemetry.flush()

    def save_model(self, state: dict[str, torch.Tensor]) -> Path:
        import torch  # kept off the launch path: the CLI imports this module before torch is needed

        target = self.path / "model.pt"
        write_atomic(target, lambda handle: torch.save(state, handle))
        for listener in self._listeners:
            listener.on_model(target)
        return target

    def save_summary(self, summary: dict[str, Any]) -> Path:
        target = self.path / "summary.json"
        redacted = redact_all(summary)
        text = json.dumps(redacted, indent=2, sort_keys=True).encode()
        write_atomic(target, lambda handle: handle.write(text))
        for listener in self._listeners:
            listener.on_summary(redacted)
        return target

    def close(self, *, discard_unsaved: bool = False) -> None:
        """Close the logs (again is fine). ``discard_unsaved``: a new run whose job was never
        saved (it failed before it began; there is nothing to resume) also deletes what it
        wrote, so the same path can start a run again: all its folder holds (it was missing or
        empty, and from its claim (``_claim``) no other run writes there), ``run_id`` last (no
        other run can take the folder before), then the folder if it made it (only if empty:
        a run started since keeps it). Only while ``run_id`` still holds this run's id: else
        the folder is not its own and nothing is deleted. Best effort: it runs on the way out
        of a failure, which is the error to report."""
        self._events.close()
        self._telemetry.close()
        if not (discard_unsaved and self._new and not self._saved):
            return
        with contextlib.suppress(OSError, ConfigError):
            if read_run_id(self.path) != self.run_id:
                return
            for entry in self.path.iterdir():
                if entry.name == RUN_ID_FILE:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
            (self.path / RUN_ID_FILE).unlink()
            if self._made:
                self.path.rmdir()
