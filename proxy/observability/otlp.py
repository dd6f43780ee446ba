"""OTLP/HTTP span export: the protobuf wire format of ExportTraceServiceRequest, written by hand, and the POST.

Owns encoding the traces tracing.py records (string, bool, int, float and list attributes; events; status)
and sending them from the batch processor's thread (each queue entry is one request's RequestTrace). The SDK's own encoder builds a message object per
field and cost ~85 us a span here, more than the rest of the proxy's work on a request; this one ~10 us.
Settings follow the SDK's: OTEL_EXPORTER_OTLP_[TRACES_]HEADERS, _TIMEOUT, _COMPRESSION (gzip).
"""

from __future__ import annotations

import gzip
import logging
import os
import struct
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger("kvroute.tracing")

_PACK_DOUBLE = struct.Struct("<d").pack
_PACK_FIXED64 = struct.Struct("<Q").pack
_KIND = {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}  # SDK SpanKind value (INTERNAL=0...) -> OTLP enum (INTERNAL=1...)
_STATUS = {0: 0, 1: 1, 2: 2}  # UNSET, OK, ERROR: the same numbers


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    if value < _SMALL_LIMIT:
        return _SMALL[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL_LIMIT = 1 << 14
_SMALL = tuple(bytes((v,)) if v < 0x80 else bytes(((v & 0x7F) | 0x80, v >> 7)) for v in range(_SMALL_LIMIT))


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2) whose tag byte is `tag`."""
    n = len(payload)
    return tag + (_SMALL[n] if n < _SMALL_LIMIT else _varint(n)) + payload


def _string(tag: bytes, text: str) -> bytes:
    return _field(tag, text.encode("utf-8", "replace")) if text else b""


# tag bytes of length-delimited fields 1..15: (number << 3) | 2
_T = [bytes((n << 3 | 2,)) for n in range(16)]
_T1, _T2, _T3, _T4, _T5 = _T[1], _T[2], _T[3], _T[4], _T[5]
# Encoded KeyValues of scalar attributes seen before (policy, reason, worker, URL, status...): most repeat.
_CACHE_LIMIT = 4096
_UNIQUE_KEYS = frozenset(("kvroute.request_id",))
_SCALARS = (str, int, bool)  # not float: 0.0 == -0.0 would share an encoding


def _any_value(value: Any) -> bytes:
    kind = type(value)
    if kind is str:
        return _field(_T1, value.encode("utf-8", "replace"))
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is int:
        return b"\x18" + _varint(value)
    if kind is float:
        return b"\x21" + _PACK_DOUBLE(value)
    if kind is list or kind is tuple:
        return _field(_T5, b"".join([_field(_T1, _any_value(v)) for v in value]))
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(int(value))
    if isinstance(value, float):
        return b"\x21" + _PACK_DOUBLE(float(value))
    return _field(_T1, str(value).encode("utf-8", "replace"))


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None, cache: dict | None = None) -> bytes:
    if not attributes:
        return b""
    out = []
    for key, value in attributes.items():
        kind = type(value)
        memo = (tag, key, kind, value) if cache is not None and kind in _SCALARS and key not in _UNIQUE_KEYS else None
        encoded = cache.get(memo) if memo is not None else None  # type: ignore[union-attr]
        if encoded is None:
            encoded = _field(tag, _string(_T1, key) + _field(_T2, _any_value(value)))
            if memo is not None and len(cache) < _CACHE_LIMIT:  # type: ignore[arg-type]
                cache[memo] = encoded  # type: ignore[index]
        out.append(encoded)
    return b"".join(out)


_EVENTS, _ATTRS, _STATUS_FIELD, _PARENT = _T[11], _T[9], _T[15], _T4


def encode_span(span: ReadableSpan) -> bytes:
    context = span._context  # ReadableSpan's fields: its properties cost a call each
    parent = span._parent
    status = span._status
    parts = [_field(_T1, context.trace_id.to_bytes(16, "big")), _field(_T2, context.span_id.to_bytes(8, "big"))]
    if parent is not None:
        parts.append(_field(_PARENT, parent.span_id.to_bytes(8, "big")))
    parts += [_string(_T5, span._name), b"\x30" + _SMALL[_KIND.get(span._kind.value, 0)],
              b"\x39" + _PACK_FIXED64(span._start_time or 0), b"\x41" + _PACK_FIXED64(span._end_time or 0),
              _attributes(_ATTRS, span._attributes)]
    for event in span._events:
        parts.append(_field(_EVENTS, b"\x09" + _PACK_FIXED64(event.timestamp) + _string(_T2, event.name)
                            + _attributes(_T3, event.attributes)))
    code = _STATUS.get(status.status_code.value, 0)
    parts.append(_field(_STATUS_FIELD, _string(_T2, status.description or "") + (b"\x18" + _SMALL[code] if code else b"")))
    return b"".join(parts)


def encode_trace(trace: Any, cache: dict | None = None) -> list[bytes]:
    """The encoded Span messages of one tracing.RequestTrace (its plain tuples, no SDK objects)."""
    trace_id = _field(_T1, trace.trace_id.to_bytes(16, "big"))
    remote = trace.remote_parent_id
    out = []
    for name, span_id, parent_id, kind, start_ns, end_ns, attributes, events, error in trace.spans:
        parent = remote if parent_id is None else parent_id
        parts = [trace_id, _field(_T2, span_id.to_bytes(8, "big"))]
        if parent is not None:
            parts.append(_field(_PARENT, parent.to_bytes(8, "big")))
        parts += [_string(_T5, name), b"\x30" + _SMALL[kind], b"\x39" + _PACK_FIXED64(start_ns),
                  b"\x41" + _PACK_FIXED64(end_ns), _attributes(_ATTRS, attributes, cache)]
        for event_name, ts, event_attributes in events:
            parts.append(_field(_EVENTS, b"\x09" + _PACK_FIXED64(ts) + _string(_T2, event_name)
                                + _attributes(_T3, event_attributes, cache)))
        parts.append(_ERROR_STATUS if error else _UNSET_STATUS)
        out.append(b"".join(parts))
    return out


_ERROR_STATUS = _field(_STATUS_FIELD, b"\x18\x02")
_UNSET_STATUS = _field(_STATUS_FIELD, b"")


def encode_request(items: Sequence[Any], cache: dict | None = None) -> bytes:
    """ExportTraceServiceRequest of RequestTraces (or SDK ReadableSpans): grouped by resource, then scope.
    `cache`: a dict kept between calls (by one exporter) for the encodings of repeated attributes."""
    # keyed by identity: Resource hashes by serialising its attributes, 40 us a call
    groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    for item in items:
        if isinstance(item, ReadableSpan):
            resource, scope, encoded = item.resource, item.instrumentation_scope, [encode_span(item)]
        else:
            resource, scope, encoded = item.tracing.resource, item.tracing.scope, encode_trace(item, cache)
        scopes = groups.setdefault(id(resource), (resource, {}))[1]
        scopes.setdefault(id(scope), (scope, []))[1].extend(encoded)
    out = []
    for resource, scopes in groups.values():
        body = [_field(_T1, _attributes(_T1, resource.attributes if resource is not None else None))]
        for scope, encoded in scopes.values():
            scope_msg = (_string(_T1, scope.name) + _string(_T2, scope.version or "")) if scope is not None else b""
            body.append(_field(_T2, _field(_T1, scope_msg) + b"".join([_field(_T2, s) for s in encoded])))
        out.append(_field(_T1, b"".join(body)))
    return b"".join(out)


def _env(environ: Mapping[str, str], name: str, default: str = "") -> str:
    return environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or environ.get(f"OTEL_EXPORTER_OTLP_{name}") or default


def parse_headers(text: str) -> dict[str, str]:
    """OTEL_EXPORTER_OTLP_HEADERS: `key1=value1,key2=value2`, values URL-encoded."""
    headers = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            headers[key.strip().lower()] = urllib.parse.unquote(value.strip())
    return headers


class OtlpHttpExporter(SpanExporter):
    """POSTs each batch as application/x-protobuf; runs on the BatchSpanProcessor's thread, never the loop."""

    def __init__(self, url: str, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.url = url
        self.headers = {"Content-Type": "application/x-protobuf", **parse_headers(_env(env, "HEADERS"))}
        self.gzip = _env(env, "COMPRESSION").lower() == "gzip"
        if self.gzip:
            self.headers["Content-Encoding"] = "gzip"
        self.timeout_s = float(_env(env, "TIMEOUT", "10000")) / 1000  # the SDK reads milliseconds
        self.failures = 0
        self.cache: dict = {}  # only the export thread uses it

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        body = encode_request(spans, self.cache)
        if self.gzip:
            body = gzip.compress(body, compresslevel=1)
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except (urllib.error.URLError, OSError, ValueError) as exc:
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:  # a collector that is down: not a line per batch
                log.warning("could not export %d traces to %s (%d failed batches so far): %s", len(spans),
                            self.url, self.failures, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None
