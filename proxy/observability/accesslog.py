"""Structured access logs: one JSON object per proxied request on the `kvroute.access` logger, at INFO.

Owns the line's fields and their encoding (orjson, one dict) and the batching of lines: kept in a list and
written to the logger's handlers in one write per batch (every FLUSH_S on the loop, at FLUSH_LINES, at close and
at exit), formatted as each handler formats any record. Where lines go is the logging setup's (`kvroute proxy`:
stderr; `kvroute up`: its log file). Costs nothing when the logger is not enabled for INFO.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import logging.handlers
import threading
import time
import weakref
from array import array
from typing import Any

import orjson

LOGGER_NAME = "kvroute.access"
# A line reaches its log at most this long after its request ended (a batch written on the loop).
FLUSH_S = 0.2
# A batch this long is written at once, without waiting for the timer.
FLUSH_LINES = 256

# Handlers whose stream this module writes a batch to itself (one write and one flush per batch); any
# other handler (a queue, a test's capture, filters) gets one record per line, as logger.info would.
_STREAM_HANDLERS = (logging.StreamHandler, logging.FileHandler, logging.handlers.RotatingFileHandler)
_open_logs: weakref.WeakSet[AccessLog] = weakref.WeakSet()


class AccessLog:
    """Collects one line per request when `kvroute.access` is enabled for INFO (proxy.access_log, log_level)
    and writes them in batches; `flush()` writes what is pending now."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(LOGGER_NAME)
        # Pending lines: JSON, one per line, and when each was written. Kept in one buffer, as orjson's own
        # bytes objects held in a list cost more to keep than to make (each keeps its allocation's slack).
        self.buffer = bytearray()
        self.times = array("d")
        self.lock = threading.Lock()  # the loop writes while close() may flush from a thread
        self.timer: asyncio.TimerHandle | None = None
        self._seconds: dict[tuple[Any, ...], tuple[bytes, bytes | None]] = {}  # asctime up to the second, per formatter's clock
        _open_logs.add(self)

    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)  # logging caches this per logger

    def write(self, record: dict[str, Any]) -> None:
        """`record`'s keys in order, None values included (a field is always there, so lines parse alike)."""
        line = orjson.dumps(record)
        with self.lock:
            buffer = self.buffer
            buffer += line
            buffer += b"\n"
            times = self.times
            times.append(time.time())
            pending = len(times)
        if pending >= FLUSH_LINES:
            self.flush()
        elif self.timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (an in-process measurement): written at FLUSH_LINES or flush()
                return
            self.timer = loop.call_later(FLUSH_S, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        self.flush()

    def flush(self) -> None:
        """Write every pending line (on the loop, or from any thread at close and at exit)."""
        with self.lock:
            buffer, times = self.buffer, self.times
            self.buffer, self.times = bytearray(), array("d")
        if times:
            self._emit(list(zip(times, buffer.split(b"\n"), strict=False)))

    # --- writing a batch as the logging setup would write each line ---------------------------------------
    def _emit(self, lines: list[tuple[float, bytearray]]) -> None:
        logger = self.logger
        record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, "", None, None)
        if logger.disabled or (logger.filters and not logger.filter(record)):
            return
        handlers: list[logging.Handler] = []
        node: logging.Logger | None = logger
        while node is not None:
            handlers.extend(h for h in node.handlers if logging.INFO >= h.level)
            if not node.propagate:
                break
            node = node.parent  # type: ignore[assignment]
        for handler in handlers:
            if type(handler) in _STREAM_HANDLERS and not handler.filters:
                self._write_batch(handler, record, lines)
            else:
                for created, line in lines:
                    one = logger.makeRecord(logger.name, logging.INFO, __file__, 0, line.decode(), None, None)
                    one.created, one.msecs = created, (created - int(created)) * 1000
                    handler.handle(one)

    def _write_batch(self, handler: logging.Handler, record: logging.LogRecord,
                     lines: list[tuple[float, bytearray]]) -> None:
        formatter = handler.formatter or logging._defaultFormatter  # type: ignore[attr-defined]
        terminator = getattr(handler, "terminator", "\n")
        try:
            text = self._formatted(formatter, record, lines, terminator)
            handler.acquire()
            try:
                if isinstance(handler, logging.handlers.RotatingFileHandler):
                    if handler.stream is None:
                        handler.stream = handler._open()
                    if handler.maxBytes > 0:
                        handler.stream.seek(0, 2)
                        if handler.stream.tell() + len(text) >= handler.maxBytes:
                            handler.doRollover()
                elif isinstance(handler, logging.FileHandler) and handler.stream is None:
                    handler.stream = handler._open()
                handler.stream.write(text)  # type: ignore[attr-defined]
                handler.flush()
            finally:
                handler.release()
        except Exception:  # as logging does: report on stderr, never fail the caller
            handler.handleError(record)

    def _formatted(self, formatter: logging.Formatter, record: logging.LogRecord,
                   lines: list[tuple[float, bytearray]], terminator: str) -> str:
        """The batch as `formatter` would format each line. A plain Formatter's template is filled once per
        batch (the time and the message stand in as markers) and each line is spliced into it."""
        plain = (type(formatter).format is logging.Formatter.format
                 and type(formatter).formatMessage is logging.Formatter.formatMessage)
        uses_time = formatter.usesTime()
        default_clock = type(formatter).formatTime is logging.Formatter.formatTime
        pieces = None
        if plain and (default_clock or not uses_time):
            record.asctime, record.message = _TIME_MARK, _MESSAGE_MARK
            pieces = _split(formatter.formatMessage(record) + terminator, uses_time)
        if pieces is None:  # a formatter of its own: asked line by line
            out = []
            for created, line in lines:
                record.created, record.msecs = created, (created - int(created)) * 1000
                record.msg, record.args = line.decode(), None
                out.append(formatter.format(record) + terminator)
            return "".join(out)
        head, mid, tail, time_first = pieces
        parts: list[bytes | bytearray] = []
        extend = parts.extend
        if not uses_time:
            for _, line in lines:
                extend((head, line, tail))
        else:
            asctime = self._asctime
            for created, line in lines:
                stamp = asctime(formatter, created)
                extend((head, stamp, mid, line, tail) if time_first else (head, line, mid, stamp, tail))
        return b"".join(parts).decode()

    def _asctime(self, formatter: logging.Formatter, created: float) -> bytes:
        """Formatter.formatTime's answer (as bytes), its strftime done once per second."""
        second = int(created)
        key = (formatter.converter, formatter.datefmt, formatter.default_time_format, second)
        cached = self._seconds.get(key)
        if cached is None:
            if len(self._seconds) > 64:
                self._seconds.clear()
            text = time.strftime(formatter.datefmt or formatter.default_time_format, formatter.converter(created))
            msec_format = formatter.default_msec_format if not formatter.datefmt else None
            cached = self._seconds[key] = (text.encode(), msec_format.encode() if msec_format else None)
        text_bytes, msec_format_bytes = cached
        if msec_format_bytes is None:
            return text_bytes
        return msec_format_bytes % (text_bytes, (created - second) * 1000)


_TIME_MARK, _MESSAGE_MARK = "\x00kvroute-asctime\x00", "\x00kvroute-message\x00"


def _split(template: str, uses_time: bool) -> tuple[bytes, bytes, bytes, bool] | None:
    """A formatted line's template -> the bytes around its time and its message (None: they are not each
    there once)."""
    if template.count(_MESSAGE_MARK) != 1 or template.count(_TIME_MARK) != (1 if uses_time else 0):
        return None
    if not uses_time:
        head, tail = template.split(_MESSAGE_MARK)
        return head.encode(), b"", tail.encode(), False
    time_first = template.index(_TIME_MARK) < template.index(_MESSAGE_MARK)
    first, second = (_TIME_MARK, _MESSAGE_MARK) if time_first else (_MESSAGE_MARK, _TIME_MARK)
    head, rest = template.split(first)
    mid, tail = rest.split(second)
    return head.encode(), mid.encode(), tail.encode(), time_first


@atexit.register
def _flush_at_exit() -> None:
    """Lines of a proxy whose loop ended without closing its data plane still reach the log (before
    logging's own exit hook, registered earlier, closes the handlers)."""
    for access in list(_open_logs):
        access.flush()
