"""Log lines of every service: the request id on each line logged on a request's behalf, and
``--log-format {text,json}``.

The id lives in a context variable. gRPC and HTTP handlers each run in their own asyncio task,
and a task copies its context when created, so an id bound by a handler stays on every line
that handler and the tasks it starts log, and on no other request's. The router binds the id
it admits a request under; workers bind the id the router sent (``PrefillRequest.request_id``,
the handoff header's ``request_id``), so one id follows a request router → prefill → decode.
"""

from __future__ import annotations

import argparse
import contextvars
import datetime
import json
import logging
import sys
from typing import TextIO

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# NOTE: a context variable, not shared state: each task (request) sees its own value
_REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("flashsplit_request_id",
                                                                  default="")


def add_log_format_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="'text': one readable line per record; 'json': one JSON object per "
                        "line (time, level, logger, message, request_id where known) "
                        "(default: %(default)s)")


def bind_request_id(request_id: str) -> None:
    """Put ``request_id`` on every record logged from here on in this task (and in the tasks
    it starts). An empty id binds nothing."""
    if request_id:
        _REQUEST_ID.set(request_id)


def current_request_id() -> str:
    """The id bound in this task, or ""."""
    return _REQUEST_ID.get()


class RequestIdFilter(logging.Filter):
    """Sets ``record.request_id`` (on a handler, so records of every logger get it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = _REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, with ``[request id] `` in front of the message where one is known and
    the message does not start with it already (the router's own lines name their request)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", "")
        if rid and not record.message.startswith(f"[{rid}]"):
            record = logging.makeLogRecord({**record.__dict__,
                                            "message": f"[{rid}] {record.message}"})
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``time`` (UTC, ISO 8601), ``level``,
    ``logger``, ``message``, ``request_id`` where known, ``exception`` with a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", "")
        if rid:
            line["request_id"] = rid
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str, log_format: str = "text", stream: TextIO | None = None,
                      ) -> logging.Handler:
    """Send every logger's records at ``level`` and above to ``stream`` (stderr) in
    ``log_format``, replacing the root logger's handlers; returns the handler."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler


def echo_line(process: str, line: str, log_format: str) -> str:
    """A child process's output line as ``flashsplit up`` echoes it: ``[name] line``, or in
    json, the line's object with ``"process": name`` added (a line that is not a JSON object,
    such as a crash's traceback, becomes the ``message`` of one), so the combined output
    stays one JSON object per line."""
    if log_format != "json":
        return f"[{process}] {line}"
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        record = {"message": line}
    return json.dumps({"process": process, **record}, ensure_ascii=False)


class EchoWriter:
    """A text stream for ``process``'s own plain lines (``flashsplit up``'s supervisor) that
    writes them as :func:`echo_line` does: as they are in text, one object each in json."""

    def __init__(self, stream: TextIO, process: str, log_format: str) -> None:
        self.stream = stream
        self.process = process
        self.log_format = log_format
        self._partial = ""

    def write(self, text: str) -> int:
        if self.log_format != "json":
            return self.stream.write(text)
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self.stream.write(echo_line(self.process, line, "json") + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
