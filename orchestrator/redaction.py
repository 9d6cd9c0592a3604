"""Secrets in URIs never reach a file or a terminal: ``s3://KEY:SECRET@bucket/...`` and tokens
in query strings are masked wherever ringleader prints or saves a value (events, job.json,
summary.json, warnings, messages naming a checkpoint file)."""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
# userinfo of a URI: scheme://user[:password]@host
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s?#]+)@")
# a query or fragment parameter whose name says it is secret
_SECRET_PARAM = re.compile(
    r"(?P<name>[?&;#](?:[A-Za-z0-9_.-]*?)(?:key|secret|token|signature|sig|password|passwd|credential|session)"
    r"[A-Za-z0-9_.-]*=)(?P<value>[^&;#\s\"']*)",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with the userinfo of every URI and the values of secret-looking query
    parameters replaced by ``***``."""
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    return _SECRET_PARAM.sub(lambda m: f"{m['name']}{MASK}", text)


def redact_all(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strings, numbers) with every string redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redact_all(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_all(item) for item in value]
    return value
