"""Logging every silod process shares: one line per event on stderr, JSON or text.

JSON lines are for log shippers (fields ``ts``, ``level``, ``logger``, ``msg`` and every
``extra=`` key); text is for a human at a terminal. Code logs through the standard
:mod:`logging` API with ``extra={...}``, so libraries and tests (``caplog``) keep working.

The id of the RPC being served is kept in a context variable, so any line a servicer logs
while handling a call carries ``request_id`` without passing it around.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
import traceback
from typing import Any

from services.runtime.settings import ServiceSettings

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("silod_request_id", default="")

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    fields = {k: v for k, v in vars(record).items() if k not in _RECORD_ATTRS and not k.startswith("_")}
    request_id = request_id_var.get()
    if request_id and "request_id" not in fields:
        fields["request_id"] = request_id
    return fields


def _timestamp(record: logging.LogRecord) -> str:
    # UTC with milliseconds: sortable and unambiguous across hosts.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class JsonFormatter(logging.Formatter):
    def __init__(self, static: dict[str, Any] | None = None) -> None:
        super().__init__()
        self._static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **self._static,
            **_extras(record),
        }
        if record.exc_info:
            line["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        # default=str: an odd extra (a Path, an enum) must never cost us the log line.
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        parts = [_timestamp(record), record.levelname, record.name, record.getMessage()]
        parts += [f"{k}={v}" for k, v in _extras(record).items()]
        text = " ".join(str(p) for p in parts)
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
        return text


class _SilodHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler we installed, so configuring twice replaces it instead of doubling lines."""


def configure_logging(settings: ServiceSettings, *, process: str = "") -> None:
    """Send all logging to stderr in ``settings.log_format`` at ``settings.log_level``.

    ``process`` (e.g. "metadata") is added to every JSON line so mixed logs stay attributable.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _SilodHandler):
            root.removeHandler(handler)
    handler = _SilodHandler(sys.stderr)
    if settings.log_format == "json":
        handler.setFormatter(JsonFormatter({"process": process} if process else None))
    else:
        handler.setFormatter(TextFormatter())
    root.addHandler(handler)
    logging.captureWarnings(True)  # so that warnings, too, arrive as one parseable line
    level = logging.getLevelName(settings.log_level.upper())
    root.setLevel(level)
    # gRPC's debug lines (event-loop plumbing) would bury ours when debugging a service.
    logging.getLogger("grpc").setLevel(max(level, logging.INFO))


def get_logger(name: str) -> logging.Logger:
    """A logger under the ``silod`` hierarchy, so our lines are easy to tell from libraries'."""
    return logging.getLogger(name if name == "silod" or name.startswith("silod.") else f"silod.{name}")
