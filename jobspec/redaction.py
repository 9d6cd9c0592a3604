"""Secrets in URIs never reach a file or a terminal: ``s3://KEY:SECRET@bucket/...`` and tokens
in query strings are masked wherever ringleader prints or saves a value (events, job.json,
summary.json, warnings, messages naming a checkpoint file)."""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
# userinfo of a URI: scheme://user[:password]@host
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s?#]+)@")
# a query parameter of a URI: ?name=value or &name=value
_PARAM = re.compile(r"(?P<lead>[?&])(?P<name>[A-Za-z0-9_.-]+)=(?P<value>[^&#\s\"']*)")
# A parameter is secret when the last word of its name is one of these (``X-Amz-Signature``,
# ``access_token``, ``key``), never because a word merely contains one (``monkey``,
# ``session_name``, ``keyframe``).
_SECRET_WORDS = frozenset(
    {"key", "secret", "token", "signature", "sig", "password", "passwd", "pwd", "credential", "credentials", "auth"}
)


def _secret_param(match: re.Match[str]) -> str:
    last = re.split(r"[_.-]", match["name"].lower())[-1]
    secret = last in _SECRET_WORDS or match["name"].lower() in ("apikey", "accesskey", "sessiontoken")
    return f"{match['lead']}{match['name']}={MASK}" if secret else match[0]


def redact(text: str) -> str:
    """``text`` with the userinfo of every URI and the values of its secret-named query
    parameters replaced by ``***``. Text without ``://`` is returned as it is."""
    if "://" not in text:
        return text
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    return _PARAM.sub(_secret_param, text)


def masked(text: str) -> bool:
    """Whether ``text`` holds a value ``redact`` masked (read back from a saved file)."""
    return "://" in text and (f"://{MASK}@" in text or f"={MASK}" in text)


def redact_all(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strings, numbers) with every string redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redact_all(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_all(item) for item in value]
    return value
