"""Prometheus text format: the one parser behind every /metrics reader (proxy scrape, worker adapters, bench).

Owns turning exposition text into samples and the reductions those readers share, including THE rule
for KV usage across data-parallel engines; it does no I/O and imports nothing of the proxy (a leaf).

A malformed line is skipped instead of failing the whole scrape (a worker's /metrics is input we do not
control); every sample keeps its own name (`x_total`, `x_bucket`, ...). Across several label sets (vLLM's
data-parallel ranks) KV usage is the MEAN of the ranks and capacity the SUM, counts and counters are summed,
and non-finite values are left out of every reduction. Why the mean: docs/design/engines.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# One label and what ends it: `name="value"` then `,` or `}`. The value alternation cannot backtrack.
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*([,}])')
_ESCAPE = re.compile(r'\\[\\n"]')
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


class Sample(NamedTuple):
    """One line of the exposition: its sample name, labels (unescaped), value and timestamp."""

    name: str
    labels: dict[str, str]
    value: float
    timestamp: float | None = None  # seconds since the epoch (the text writes milliseconds)


class Metrics:
    """The samples of one /metrics text, grouped by sample name in the order they appeared."""

    __slots__ = ("by_name",)

    def __init__(self, by_name: dict[str, list[Sample]] | None = None) -> None:
        self.by_name: dict[str, list[Sample]] = by_name if by_name is not None else {}

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def samples(self, name: str, where: Mapping[str, str] | None = None) -> list[Sample]:
        """Samples of `name` whose labels include every `where` pair."""
        found = self.by_name.get(name, [])
        if not where:
            return list(found)
        return [s for s in found if all(s.labels.get(k) == v for k, v in where.items())]

    def values(self, name: str, where: Mapping[str, str] | None = None) -> list[float]:
        """Finite values of `name` across its label sets (filtered by `where`)."""
        return [s.value for s in self.samples(name, where) if math.isfinite(s.value)]

    def total(self, name: str, where: Mapping[str, str] | None = None) -> float | None:
        """Sum over label sets; None when the series is absent (or has no finite value)."""
        values = self.values(name, where)
        return math.fsum(values) if values else None

    def mean(self, name: str, where: Mapping[str, str] | None = None) -> float | None:
        values = self.values(name, where)
        return math.fsum(values) / len(values) if values else None

    def maximum(self, name: str, where: Mapping[str, str] | None = None) -> float | None:
        values = self.values(name, where)
        return max(values) if values else None

    def totals(self) -> dict[str, float]:
        """Every sample name -> its sum over label sets (a flat view for before/after deltas)."""
        out = {}
        for name in self.by_name:
            total = self.total(name)
            if total is not None:
                out[name] = total
        return out


def parse(text: str, names: Iterable[str] | None = None, prefixes: Iterable[str] | None = None) -> Metrics:
    """Samples from Prometheus text; only those named in `names` / starting with a `prefixes` entry, if given.

    vLLM's /metrics is tens of kilobytes of histograms read at 4 Hz: with a filter, lines of other
    series are skipped with one startswith and never parsed.
    """
    wanted = set(names) if names is not None else None
    heads = tuple(prefixes or ())
    starts = heads + tuple(wanted or ())
    by_name: dict[str, list[Sample]] = {}
    for line in text.splitlines():
        if line[:1] in (" ", "\t"):
            line = line.lstrip(" \t")
        if not line or line[0] == "#":
            continue
        if starts and not line.startswith(starts):
            continue
        sample = parse_line(line)
        if sample is None:
            continue
        if wanted is not None and sample.name not in wanted and not (heads and sample.name.startswith(heads)):
            continue
        by_name.setdefault(sample.name, []).append(sample)
    return Metrics(by_name)


def parse_line(line: str) -> Sample | None:
    """One sample line (no leading blanks), or None if it is not one."""
    m = _NAME.match(line)
    if m is None:
        return None
    name, pos, end = m.group(), m.end(), len(line)
    if pos < end and line[pos] not in " \t{":  # `foo-1 2` is no sample of `foo`
        return None
    while pos < end and line[pos] in " \t":
        pos += 1
    labels: dict[str, str] = {}
    if pos < end and line[pos] == "{":
        pos += 1
        while True:
            while pos < end and line[pos] in " \t":
                pos += 1
            if pos < end and line[pos] == "}":  # `{}` or a trailing comma
                pos += 1
                break
            lm = _LABEL.match(line, pos)
            if lm is None:
                return None
            value = lm.group(2)
            labels[lm.group(1)] = _ESCAPE.sub(_unescape, value) if "\\" in value else value
            pos = lm.end()
            if lm.group(3) == "}":
                break
    fields = line[pos:].split()
    if not fields or len(fields) > 2:
        return None
    try:
        value = _number(fields[0])
        timestamp = _number(fields[1]) / 1000 if len(fields) == 2 else None
    except ValueError:
        return None
    return Sample(name, labels, value, timestamp)


def _number(text: str) -> float:
    if "_" in text:  # float() takes "1_000"; the format does not
        raise ValueError(text)
    return float(text)


def _unescape(match: re.Match[str]) -> str:
    return _UNESCAPED[match.group()]


# --- KV cache across data-parallel engines: the one rule (see the module docstring) ---------------


def kv_usage(metrics: Metrics, names: Iterable[str]) -> float | None:
    """The worker's KV usage (0..1): the mean over label sets of the first of `names` present.

    Engines call it "perc" but report a fraction; a value over 1 is taken for a true percent.
    """
    for name in names:
        usage = metrics.mean(name)
        if usage is not None:
            if usage > 1.0:
                usage /= 100.0
            return min(max(usage, 0.0), 1.0)
    return None


def kv_block_size(metrics: Metrics, info_name: str) -> int | None:
    """Tokens per KV block, from the `block_size` label of an info series (vLLM's `cache_config_info`); None if absent."""
    for sample in metrics.samples(info_name):
        try:
            return int(sample.labels["block_size"]) or None
        except (KeyError, ValueError):
            continue
    return None


def kv_capacity_tokens(metrics: Metrics, info_name: str) -> int | None:
    """Tokens of KV cache, summed over label sets of an info series with `num_gpu_blocks` and `block_size`
    labels (vLLM's `cache_config_info`, one per engine rank); None if absent."""
    tokens = 0
    for sample in metrics.samples(info_name):
        try:
            tokens += int(sample.labels["num_gpu_blocks"]) * int(sample.labels["block_size"])
        except (KeyError, ValueError):
            continue
    return tokens or None
