"""Logging for server processes: every line about a session carries its session id, from
a context variable set when a stream is admitted (``SessionManager.run``, in the stream's
task; ``runner.py`` carries it to pool threads).
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar

__all__ = ["SESSION_ID", "configure_logging"]

#: The current session's id ("-" outside any session).
SESSION_ID: ContextVar[str] = ContextVar("openenv_session_id", default="-")


def _add_session(record: logging.LogRecord) -> bool:
    record.session = SESSION_ID.get()
    return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, session, message, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "session": getattr(record, "session", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Log to stderr at ``level`` as ``text`` or ``json`` lines (ValueError: unknown)."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.addFilter(_add_session)
    text = logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(session)s] %(message)s")
    handler.setFormatter(JsonFormatter() if fmt == "json" else text)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
