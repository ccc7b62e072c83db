"""Logging: named loggers, a request id on every line about a request, text or JSON lines.

The request boundary sets ``request_id`` (a context variable) for everything
the request's task logs; a filter copies it onto each record. The access
log (``dpu_frontend.access``) uses the conventional combined format plus the
request id and the time taken.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

#: Apache combined log format, then the request id and the seconds taken.
ACCESS_FORMAT = '%a - - %t "%r" %s %b "%{Referer}i" "%{User-Agent}i" rid=%{X-Request-Id}o %Tf'


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, request_id, message (and the traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name,
            "request_id": getattr(record, "request_id", "-"), "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str = "INFO", fmt: str = "text") -> None:
    if fmt not in ("text", "json"):
        raise ValueError(f"log_format must be text or json, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
