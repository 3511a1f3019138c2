"""Log lines: the request id bound by a task is on its lines (and on no other task's), in
text and in one-JSON-object-per-line form; ``flashsplit up``'s echo keeps the form."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from common.logging_setup import (EchoWriter, bind_request_id, configure_logging,
                                  current_request_id, echo_line)


@pytest.fixture
def captured():
    """Root logging into a buffer for the test, the previous set-up restored after."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buffer = io.StringIO()

    def configure(log_format: str) -> io.StringIO:
        configure_logging("INFO", log_format, stream=buffer)
        return buffer

    yield configure
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in saved[0]:
        root.addHandler(handler)
    root.setLevel(saved[1])


async def handle(request_id: str, log: logging.Logger) -> None:
    """What a handler does: bind its request's id, log, start a task that logs."""
    bind_request_id(request_id)
    log.info("admitted")
    await asyncio.sleep(0)
    await asyncio.to_thread(log.info, "tokenized")  # to_thread copies the context too
    await asyncio.create_task(_child(log))


async def _child(log: logging.Logger) -> None:
    log.warning("attempt failed")


def test_json_lines_carry_each_tasks_own_request_id(captured):
    out = captured("json")
    log = logging.getLogger("flashsplit.test")

    async def scenario():
        await asyncio.gather(handle("req-a", log), handle("req-b", log))
        log.info("no request here")

    asyncio.run(scenario())
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert {tuple(sorted(r)) for r in records[:-1]} == {
        ("level", "logger", "message", "request_id", "time")}
    by_id = {}
    for r in records[:-1]:
        by_id.setdefault(r["request_id"], []).append((r["level"], r["message"]))
    steps = [("INFO", "admitted"), ("INFO", "tokenized"), ("WARNING", "attempt failed")]
    assert by_id == {"req-a": steps, "req-b": steps}
    last = records[-1]
    assert "request_id" not in last and last["message"] == "no request here"
    assert last["logger"] == "flashsplit.test" and last["time"].endswith("Z")
    assert current_request_id() == ""  # the tasks' ids never leaked into this context


def test_json_lines_keep_a_traceback_on_one_line(captured):
    out = captured("json")
    try:
        raise ValueError("broken")
    except ValueError:
        logging.getLogger("flashsplit.test").exception("step failed")
    (line,) = out.getvalue().splitlines()
    record = json.loads(line)
    assert record["level"] == "ERROR" and "ValueError: broken" in record["exception"]


def test_text_lines_name_the_request_once(captured):
    out = captured("text")
    log = logging.getLogger("flashsplit.test")

    async def scenario():
        bind_request_id("req-7")
        log.info("prefilled %d tokens", 9)
        log.info("[req-7] done")  # the router's lines name their request themselves

    asyncio.run(scenario())
    first, second = out.getvalue().splitlines()
    assert first.endswith("INFO flashsplit.test: [req-7] prefilled 9 tokens")
    assert second.endswith("INFO flashsplit.test: [req-7] done")


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="log format"):
        configure_logging("INFO", "xml", stream=io.StringIO())


def test_the_echo_of_up_stays_one_json_object_per_line():
    line = json.dumps({"time": "t", "level": "INFO", "message": "hi", "request_id": "r"})
    assert json.loads(echo_line("decode-0", line, "json")) == {
        "process": "decode-0", "time": "t", "level": "INFO", "message": "hi",
        "request_id": "r"}
    # a line that is no JSON object (a crash's traceback) becomes the message of one
    assert json.loads(echo_line("decode-0", "Traceback (most recent call last):", "json")) \
        == {"process": "decode-0", "message": "Traceback (most recent call last):"}
    assert echo_line("decode-0", "plain", "text") == "[decode-0] plain"
    stream = io.StringIO()
    writer = EchoWriter(stream, "up", "json")
    print("warning: decode-0 exited", file=writer, flush=True)
    assert json.loads(stream.getvalue()) == {"process": "up",
                                             "message": "warning: decode-0 exited"}
