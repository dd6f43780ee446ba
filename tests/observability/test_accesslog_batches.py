"""The access log writes its lines in batches: each still reaches the log soon after its request, formatted as
the logging setup formats any line, and none is lost when the proxy closes.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import logging.handlers

import pytest

from proxy.observability.accesslog import FLUSH_LINES, AccessLog
from tests.support.procs import wait_until

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@pytest.fixture
def logger():
    lg = logging.getLogger("kvroute.access.test-batches")
    lg.setLevel(logging.INFO)
    lg.propagate = False
    yield lg
    for handler in list(lg.handlers):
        lg.removeHandler(handler)
        handler.close()


def _stream_handler(lg: logging.Logger, fmt: str = FORMAT, datefmt: str | None = None) -> io.StringIO:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter(fmt, datefmt))
    lg.addHandler(handler)
    return out


def _records(text: str) -> list[dict]:
    return [json.loads(line.split("kvroute.access.test-batches: ", 1)[1]) for line in text.splitlines()]


def test_a_line_reaches_the_log_by_the_flush_timer_on_a_running_loop(logger):
    out = _stream_handler(logger)
    access = AccessLog(logger)

    async def serve() -> None:
        access.write({"request_id": "a", "status": 200})
        access.write({"request_id": "b", "status": 499})
        assert out.getvalue() == ""  # batched: nothing written per line
        await asyncio.to_thread(wait_until, lambda: out.getvalue().count("\n") == 2, 2.0, 0.01, "two lines")

    asyncio.run(serve())
    assert _records(out.getvalue()) == [{"request_id": "a", "status": 200}, {"request_id": "b", "status": 499}]


def test_lines_look_as_logger_info_writes_them(logger):
    out = _stream_handler(logger)
    custom = _stream_handler(logger, "[%(name)s] %(message)s at %(asctime)s", datefmt="%H:%M")
    access = AccessLog(logger)
    access.write({"n": 1})
    access.flush()
    logger.info('{"n":1}')
    batched, direct = out.getvalue().splitlines()
    assert batched.split(" ", 2)[2] == direct.split(" ", 2)[2]  # after the time: identical
    assert batched[:19] == direct[:19] or batched[:16] == direct[:16]  # the same second (or minute, at a tick)
    first, second = custom.getvalue().splitlines()
    assert first.rsplit(" at ", 1)[0] == second.rsplit(" at ", 1)[0] == '[kvroute.access.test-batches] {"n":1}'


def test_a_full_batch_is_written_at_once_and_close_writes_the_rest(logger, tmp_path):
    path = tmp_path / "kvroute-up.log"
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=10 * 2**20, backupCount=1)
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    access = AccessLog(logger)
    for i in range(FLUSH_LINES + 3):  # no loop: only the batch size and flush() write
        access.write({"i": i})
    assert len(path.read_text().splitlines()) == FLUSH_LINES
    access.flush()  # what the data plane's close does
    assert [r["i"] for r in _records(path.read_text())] == list(range(FLUSH_LINES + 3))


def test_a_handler_of_another_kind_gets_one_record_per_line(logger):
    seen: list[logging.LogRecord] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    logger.addHandler(Capture())
    access = AccessLog(logger)
    access.write({"i": 1})
    access.write({"i": 2})
    access.flush()
    assert [json.loads(r.getMessage()) for r in seen] == [{"i": 1}, {"i": 2}]
    assert all(r.levelno == logging.INFO and r.name == logger.name for r in seen)
