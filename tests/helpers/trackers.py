"""User trackers for tests: one that records every call to a JSON file, one that fails."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping


class RecordingTracker:
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.calls: list[list[Any]] = []

    def _record(self, *call: Any) -> None:
        self.calls.append(list(call))
        self.path.write_text(json.dumps(self.calls, default=str))

    def start(self, run_dir: Path, config: Mapping[str, Any]) -> None:
        self._record("start", str(run_dir), config["name"])

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        self._record("log_step", step, dict(metrics))

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self._record("log_eval", step, dict(metrics))

    def finish(self, status: str, summary: Mapping[str, Any], model: Path | None) -> None:
        self._record("finish", status, summary["steps"], str(model))


class FailingTracker:
    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        raise ConnectionError("tracking server unreachable")
