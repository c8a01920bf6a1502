"""What the workers did over a sliding window, from their own ``/metrics``. Pure: the sampler
(``router.fleet.scrape``) scrapes and hands the text here with the time it was read.

Per worker the router keeps the samples of the last window (plus one older, as the baseline) and
sums the counters' increases between consecutive samples, each charged to the role the worker had
at the later sample. An interval across a role switch is dropped (the worker was draining); a
counter that went down (the stage restarted) counts from zero.

Units of work per role: images and video frames encoded (encoder: a sampled frame counts as an image,
which is about what it costs the tower at the same size), prompt tokens (prefill), generated tokens
(decode). Busy time: the stage's ``epd_engine_step_seconds`` sum (prefill, decode, colocated) or
``epd_encoder_seconds`` sum (encoder), i.e. its own step times.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

from router.plan.ratio import RoleLoad

STEP_SECONDS = "epd_engine_step_seconds_sum"
ENCODE_SECONDS = "epd_encoder_seconds_sum"
UNITS = {"encoder": ("epd_encoder_images_encoded_total", "epd_encoder_video_frames_encoded_total"),
         "prefill": ("epd_prompt_tokens_total",), "decode": ("epd_generation_tokens_total",),
         "colocated": ("epd_generation_tokens_total",)}
QUEUE = {"encoder": "epd_encoder_queue_depth"}  # others: epd_queue_depth
_T = TypeVar("_T")


@dataclass(frozen=True)
class Sample:
    """One scrape of one worker's /metrics."""

    at: float  # monotonic seconds
    role: str  # the worker's role when it was read
    busy_s: float  # cumulative seconds of engine steps (or vision-tower calls)
    units: float  # cumulative units of work of ``role``
    queue_depth: float
    running: float
    kv_blocks_used: float | None


def parse_sample(role: str, text: str, at: float) -> Sample:
    """A ``Sample`` of a stage's Prometheus text; ValueError if it is not Prometheus text."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value  # labelled series summed
    busy = values.get(ENCODE_SECONDS if role == "encoder" else STEP_SECONDS, 0.0)
    return Sample(at, role, busy, sum(values.get(name, 0.0) for name in UNITS.get(role, ())),
                  values.get(QUEUE.get(role, "epd_queue_depth"), 0.0), values.get("epd_running_requests", 0.0),
                  values.get("epd_kv_blocks_used"))


@dataclass
class Totals:
    units: float = 0.0
    busy_s: float = 0.0


class History:
    """Samples of each worker (by id) and of the router's own counters over ``window_s``."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._workers: dict[str, deque[Sample]] = {}
        self._router: deque[tuple[float, dict[str, float]]] = deque()

    def add(self, worker_id: str, sample: Sample) -> None:
        samples = self._workers.setdefault(worker_id, deque())
        samples.append(sample)
        _prune(samples, sample.at - self.window_s, key=lambda s: s.at)

    def add_router(self, at: float, counters: Mapping[str, float]) -> None:
        """The router's own cumulative counters (images received, TTFT and TPOT sums and counts)."""
        self._router.append((at, dict(counters)))
        _prune(self._router, at - self.window_s, key=lambda entry: entry[0])

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def latest(self, worker_id: str) -> Sample | None:
        samples = self._workers.get(worker_id)
        return samples[-1] if samples else None

    def span(self, now: float, window_s: float) -> float:
        """Seconds the router's samples cover, up to ``window_s`` back from ``now``."""
        if not self._router:
            return 0.0
        return max(0.0, now - max(now - window_s, self._router[0][0]))

    def role_totals(self, now: float, window_s: float) -> dict[str, Totals]:
        """Units and busy seconds per role, summed over the intervals that end in the window."""
        totals: dict[str, Totals] = {}
        for samples in self._workers.values():
            pairs = _pairs(list(samples), now - window_s, key=lambda s: s.at)
            for a, b in pairs:
                if a.role != b.role:
                    continue
                t = totals.setdefault(b.role, Totals())
                t.units += _increase(a.units, b.units)
                t.busy_s += _increase(a.busy_s, b.busy_s)
        return totals

    def router_increase(self, now: float, window_s: float, name: str) -> float:
        pairs = _pairs(list(self._router), now - window_s, key=lambda e: e[0])
        return sum(_increase(a[1].get(name, 0.0), b[1].get(name, 0.0)) for a, b in pairs)


def role_loads(history: History, now: float, window_s: float, workers: Mapping[str, int],
               roles: Iterable[str]) -> tuple[list[RoleLoad], dict[str, dict]]:
    """The ratio inputs for ``roles`` (with ``workers`` of each now) and a report per role:
    demand (units/s), capacity (units per busy second of one worker), utilization (busy fraction)."""
    span = history.span(now, window_s)
    totals = history.role_totals(now, window_s)
    loads, report = [], {}
    for role in roles:
        t = totals.get(role, Totals())
        demand = t.units / span if span > 0 else 0.0
        capacity = t.units / t.busy_s if t.busy_s > 0 else None
        n = workers.get(role, 0)
        loads.append(RoleLoad(role, n, demand, capacity))
        report[role] = {"workers": n, "demand_per_s": demand, "capacity_per_busy_s": capacity,
                        "utilization": t.busy_s / (span * n) if span > 0 and n else None,
                        "busy_s": t.busy_s, "units": t.units}
    return loads, report


def _increase(before: float, after: float) -> float:
    return after - before if after >= before else after  # a counter that went down: the stage restarted


def _pairs(items: list[_T], start: float, key: Callable[[_T], float]) -> list[tuple[_T, _T]]:
    """Consecutive pairs whose later item is after ``start``."""
    return [(a, b) for a, b in zip(items, items[1:]) if key(b) > start]


def _prune(items: deque[_T], start: float, key: Callable[[_T], float]) -> None:
    """Drop items older than ``start`` except the newest of them (the window's baseline)."""
    while len(items) >= 2 and key(items[1]) <= start:
        items.popleft()
