"""The stream tracker reads a first stream's events only when a migration asks (or to bound what it holds):
what it then reports is what the client got, event for event, and an error event still stops the stream at once.
"""

from __future__ import annotations

import orjson

from proxy.dataplane import migration

ROLE = b'data: {"id":"c1","created":7,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'


def _token(text: str, finish: str | None = None, usage: dict | None = None) -> bytes:
    chunk = {"id": "c1", "created": 7, "model": "m",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    if usage is not None:
        chunk["usage"] = usage
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _relay(tracker: migration.StreamTracker, pieces: list[bytes]) -> bytes:
    return b"".join(tracker.feed(p) for p in pieces)


def test_what_a_migration_reads_is_what_the_client_got():
    words = [f" w{i}" for i in range(50)]
    pieces = [ROLE] + [_token(w) for w in words]
    tracker = migration.StreamTracker(chat=True, include_usage=False)
    assert _relay(tracker, pieces) == b"".join(pieces)  # passed on unchanged, byte for byte
    assert (tracker.text, tracker.tokens, tracker.finished, tracker.blocker) == ("".join(words), 50, False, None)
    assert (tracker.id, tracker.created, tracker.model) == ("c1", 7, "m")


def test_events_split_anyhow_across_reads_are_read_alike():
    stream = ROLE + b"".join(_token(f" t{i}") for i in range(20)) + _token("", "stop") + b"data: [DONE]\n\n"
    whole = migration.StreamTracker(chat=True, include_usage=False)
    whole.feed(stream)
    split = migration.StreamTracker(chat=True, include_usage=False)
    out = _relay(split, [stream[i:i + 37] for i in range(0, len(stream), 37)])
    assert out == stream
    for tracker in (whole, split):
        assert (tracker.text, tracker.tokens, tracker.finished, tracker.done) == (
            "".join(f" t{i}" for i in range(20)), 21, True, True)


def test_a_long_answer_is_read_in_batches_so_the_held_bytes_stay_bounded():
    tracker = migration.StreamTracker(chat=True, include_usage=False)
    tracker.feed(ROLE)
    token = _token(" x")
    for _ in range(3 * migration.COMPACT_BYTES // len(token)):
        tracker.feed(token)
        assert tracker.unread_bytes < migration.COMPACT_BYTES
    assert tracker.tokens == 3 * migration.COMPACT_BYTES // len(token)


def test_usage_and_blockers_seen_lazily_count_as_before():
    usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    tracker = migration.StreamTracker(chat=True, include_usage=True)
    tracker.feed(ROLE + _token(" a") + _token(" b"))
    tracker.feed(_token(" c", usage=usage))
    tracker.feed(b'data: {"id":"c1","choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}\n\n')
    assert (tracker.tokens, tracker.prompt_tokens, tracker.blocker) == (4, 9, "reasoning")


def test_an_error_event_stops_the_stream_at_once_even_between_lazy_reads():
    tracker = migration.StreamTracker(chat=True, include_usage=False)
    first = ROLE + _token(" a")
    assert tracker.feed(first) == first
    out = tracker.feed(_token(" b") + b'data: {"error": {"message": "engine dead"}}\n\n')
    assert out == _token(" b") and tracker.broken is not None
    assert (tracker.text, tracker.tokens) == (" a b", 2)


def test_keep_alive_comments_among_chunks_are_passed_on_and_skipped():
    tracker = migration.StreamTracker(chat=True, include_usage=False)
    stream = ROLE + _token(" a") + b": keep-alive\n\n" + _token(" b")
    assert tracker.feed(stream) == stream
    assert (tracker.text, tracker.tokens) == (" a b", 2)


def test_an_unreadable_event_relayed_unread_makes_the_stream_unmovable():
    tracker = migration.StreamTracker(chat=True, include_usage=False)
    stream = ROLE + _token(" a") + b"data: {not json\n\n" + _token(" b")
    assert tracker.feed(stream[:len(ROLE)]) == ROLE
    assert tracker.feed(stream[len(ROLE):]) == stream[len(ROLE):]  # the client has it already
    assert tracker.blocker is not None and tracker.broken is None
    assert tracker.feed(b"raw bytes") == b"raw bytes"  # from here on passed through as they come


def test_text_past_its_bound_is_dropped_the_stream_relayed_on_and_marked_unmovable():
    tracker = migration.StreamTracker(chat=True, include_usage=False, max_text_bytes=1000)
    words = [f" w{i:03d}" for i in range(300)]  # 1500 bytes of text; 600 small pieces joined on the way
    pieces = [ROLE] + [_token(w) for w in words]
    assert _relay(tracker, pieces[:150]) == b"".join(pieces[:150])
    assert tracker.text == "".join(words[:149]) and not tracker.text_limited  # the joined pieces read alike
    assert _relay(tracker, pieces[150:]) == b"".join(pieces[150:])  # still relayed, byte for byte
    assert tracker.text_limited and tracker.text == ""
    assert tracker.blocker == "an answer longer than proxy.limits.max_migration_text_bytes"
    assert tracker.tokens == 300  # still counted: a stream that ends whole is closed as it should be


def test_the_text_bound_counts_utf8_bytes():
    tracker = migration.StreamTracker(chat=True, include_usage=False, max_text_bytes=10)
    tracker.feed(ROLE + _token("\u00e9" * 5))  # 10 bytes: kept
    assert tracker.text == "\u00e9" * 5 and not tracker.text_limited
    tracker.feed(_token("a"))
    assert tracker.text_limited
