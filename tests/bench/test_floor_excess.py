"""bench/floor_excess.py: a route's TTFTs against the queue floor, request by request."""

from __future__ import annotations

from bench.floor_excess import excess_rows, slowest_row

FLOORS = [0.1, 0.1, 0.2, 1.0, 1.2, 1.5, 0.1, 0.3, 0.9, 2.0]
LENGTHS = [1000, 2000, 3000, 20000, 20000, 30000, 1000, 6000, 12000, 40000]


def _saved(extra: dict[int, float]) -> list[dict]:
    return [{"index": i, "ttft_s": f + extra.get(i, 0.0)} for i, f in enumerate(FLOORS)] + [
        {"index": 99, "ttft_s": 5.0},  # outside the window: ignored
        {"index": 0, "ttft_s": None}]  # no first token (failed): ignored


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip("|").split("|")]


def test_a_route_at_the_floor_shows_no_excess_and_a_late_long_prompt_shows_in_its_bucket():
    at_floor = {_cells(r)[1]: _cells(r) for r in excess_rows("a", _saved({}), FLOORS, LENGTHS)}
    assert set(at_floor) == {"0-4k", "4-8k", "8-16k", "over 16k"}
    assert [at_floor[b][2] for b in ("0-4k", "4-8k", "8-16k", "over 16k")] == ["4", "1", "1", "4"]
    assert all(row[5] == "0" and row[6] == "0" for row in at_floor.values())

    late = {_cells(r)[1]: _cells(r) for r in excess_rows("b", _saved({3: 0.5, 4: 0.5, 5: 0.5, 9: 0.5}), FLOORS,
                                                           LENGTHS)}
    assert late["over 16k"][5] == "500" and late["over 16k"][6] == "500"
    assert late["0-4k"][5] == "0"


def test_the_slowest_tenth_says_whether_the_floor_finds_those_requests_slow_too():
    # at the floor, the slowest request is the floor's slowest
    assert _cells(slowest_row("a", _saved({}), FLOORS, LENGTHS)) == ["a", "1", "2000", "2000", "1", "40000"]
    # a short prompt made late by 3 s is the slowest now, and the floor does not find it slow
    assert _cells(slowest_row("b", _saved({0: 3.0}), FLOORS, LENGTHS)) == ["b", "1", "3100", "100", "0", "1000"]
    assert slowest_row("c", [], FLOORS, LENGTHS) is None
