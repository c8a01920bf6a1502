"""What each stage of a running stack did during one workload: its busy seconds and counters from its
``/metrics`` and its processes' CPU seconds from ``/proc``, read before and after (``Probe``), plus the
machine's meters (``bench.common.meter.CpuMeter``: wall time, the client's CPU, each core's busy fraction,
load average, other processes).

Busy time is what the stages report themselves: ``epd_engine_step_seconds_sum`` (colocated, prefill,
decode: forward passes and sampling; the colocated server's and a PD prefill's steps include the
vision encoder) and ``epd_encoder_seconds_sum`` (the encoder's vision-tower calls). The router's
``epd_router_stage_seconds`` is each stage call as the router saw it (sent to last byte).
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from bench.common.meter import CpuMeter
from bench.common.proc import cpu_seconds

SCRAPE_TIMEOUT_S = 10.0
SERIES = (  # the samples kept, by their exposition name; labelled ones are summed over their labels
    "epd_engine_step_seconds_sum", "epd_engine_step_seconds_count", "epd_generation_tokens_total",
    "epd_prompt_tokens_total", "epd_kv_transfer_seconds", "epd_kv_transfer_bytes", "epd_kv_transfer_writes",
    "epd_encoder_seconds_sum", "epd_encoder_seconds_count", "epd_encoder_images_encoded_total",
    "epd_cache_hits_total", "epd_cache_misses_total", "epd_router_images_total")
PER_LABEL = {"epd_router_stage_seconds_sum": "stage", "epd_router_stage_seconds_count": "stage"}


def parse(text: str) -> dict[str, float]:
    """The ``SERIES`` samples of a /metrics text, each summed over its labels, and the ``PER_LABEL``
    ones split by their label as ``name{label=value}``. Pure."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SERIES:
                key = sample.name
            elif sample.name in PER_LABEL:
                label = PER_LABEL[sample.name]
                key = f"{sample.name}{{{label}={sample.labels.get(label, '')}}}"
            else:
                continue
            out[key] = out.get(key, 0.0) + sample.value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before for every key of ``after`` (a key new since ``before`` counts from 0). Pure."""
    return {key: round(value - before.get(key, 0.0), 6) for key, value in sorted(after.items())}


def scrape(url: str) -> dict[str, float]:
    """``parse`` of ``url``/metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=SCRAPE_TIMEOUT_S) as response:
        return parse(response.read().decode())


class Probe:
    """Started when made; ``done()`` returns the deltas since. ``urls``: role -> URL of each stage and
    the router (Redis has no /metrics); ``pids``: role -> its processes (CPU seconds are summed)."""

    def __init__(self, urls: dict[str, str], pids: dict[str, list[int]]) -> None:
        self.urls, self.pids = urls, pids
        self.series0 = {role: scrape(url) for role, url in urls.items()}
        self.cpu0 = {role: self._cpu(role) for role in pids}
        self.meter = CpuMeter({pid for group in pids.values() for pid in group}, cpu_key="client_cpu_s")

    def done(self) -> dict:
        """``machine`` (CpuMeter's dict) and ``roles``: role -> {"cpu_s", "series"} over the interval."""
        machine = self.meter.done()
        roles: dict[str, dict[str, float | dict[str, float]]] = {role: {"cpu_s": round(self._cpu(role) - self.cpu0[role], 3)} for role in self.pids}
        for role, url in self.urls.items():
            roles.setdefault(role, {})["series"] = delta(self.series0[role], scrape(url))
        return {"machine": machine, "roles": roles}

    def _cpu(self, role: str) -> float:
        total = 0.0
        for pid in self.pids[role]:
            try:
                total += cpu_seconds(pid)
            except OSError:  # a forked helper that has ended
                continue
        return total
