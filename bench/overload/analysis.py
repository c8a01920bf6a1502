"""The pure judgement of an overload run (unit-tested in tests/bench/test_overload.py): each answer,
the answers together, the processes' RSS growth, and the run's verdict."""

from __future__ import annotations

from collections import Counter

from bench.common.stats import describe

ALLOWED = (200, 429, 503)
REFUSALS = (429, 503)
SHOWN_BAD = 10  # bad answers listed in the report (all are counted)


def check_outcome(record: dict) -> str | None:
    """Why an answer is not allowed, or None: a 200 must carry a whole answer (``body_ok``), a 429 or
    503 a ``Retry-After`` of a whole number of seconds >= 0; any other status (a timeout, a transport
    error, another code) is not allowed."""
    status = record.get("status")
    if status == 200:
        return None if record.get("body_ok") else "200 with an incomplete or wrong body"
    if status in REFUSALS:
        retry = record.get("retry_after")
        valid = isinstance(retry, str) and retry.isdigit()
        return None if valid else f"{status} without a valid Retry-After ({retry!r})"
    return f"status {status} (code {record.get('code')})"


def summarize_outcomes(records: list[dict]) -> dict:
    """Counts per status (keys as strings), per refusal code, the bad answers (count, the first
    ``SHOWN_BAD`` with their reason) and latency statistics per status class."""
    bad = [{"index": r.get("index"), "status": r.get("status"), "reason": why}
           for r in records if (why := check_outcome(r)) is not None]
    by_status = Counter(str(r.get("status")) for r in records)
    codes = Counter(str(r.get("code")) for r in records if r.get("status") in REFUSALS)
    refused_by = Counter(refuser(r.get("message")) for r in records if r.get("status") in REFUSALS)
    latency = {name: describe([r["latency_s"] for r in records if str(r.get("status")) == name])
               for name in sorted(by_status)}
    return {"requests": len(records), "by_status": dict(sorted(by_status.items())), "refusal_codes": dict(codes),
            "refused_by": dict(sorted(refused_by.items())),
            "bad_count": len(bad), "bad": bad[:SHOWN_BAD], "latency_s": latency}


def refuser(message: str | None) -> str:
    """Who refused, from a refusal's message: ``router`` (its ``--max-in-flight``), ``prefill`` or
    ``decode`` (named in the message the router relays), else ``other``."""
    text = message or ""
    if "--max-in-flight" in text:
        return "router"
    for stage in ("prefill", "decode"):
        if stage in text:
            return stage
    return "other"


def rss_growth(samples: list[dict], names: list[str]) -> dict[str, dict]:
    """Per process: the RSS of the first sample (the baseline, taken before the load), its peak over
    every sample, the last sample's, and the growths ``peak - baseline`` and ``last - baseline``
    (MiB). A process missing from the first or last sample (gone) has None there."""
    out = {}
    for name in names:
        values = [s[name]["rss_mib"] for s in samples if s.get(name)]
        first, last = samples[0].get(name), samples[-1].get(name)
        base = first["rss_mib"] if first else None
        end = last["rss_mib"] if last else None
        peak = max(values) if values else None
        out[name] = {"baseline_mib": base, "peak_mib": peak, "last_mib": end,
                     "peak_growth_mib": _minus(peak, base), "last_growth_mib": _minus(end, base)}
    return out


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 1)


def verdict(outcomes: dict, growth: dict[str, dict], bound_mib: float, expected: int, finished: bool,
            recovered: dict[str, bool]) -> dict:
    """The run passes when every one of the ``expected`` requests was answered within the run's
    deadline (``finished``), every answer is allowed (``check_outcome``), at least one was a 200, each
    process's peak RSS growth is known and <= ``bound_mib``, and every process answers again after the
    burst (``recovered``: name -> ok). {"ok": bool, "reasons": [why not, ...]}."""
    reasons = []
    if not finished or outcomes["requests"] != expected:
        reasons.append(f"{outcomes['requests']} of {expected} requests answered within the run's deadline")
    if outcomes["bad_count"]:
        reasons.append(f"{outcomes['bad_count']} answers not 200, 429 or 503 with Retry-After")
    if not outcomes["by_status"].get("200"):
        reasons.append("no request succeeded")
    for name, g in growth.items():
        if g["peak_growth_mib"] is None:
            reasons.append(f"{name}: RSS not measured (process gone?)")
        elif g["peak_growth_mib"] > bound_mib:
            reasons.append(f"{name}: RSS grew {g['peak_growth_mib']} MiB > {bound_mib:g} MiB")
    reasons += [f"{name}: not healthy after the burst" for name, ok in recovered.items() if not ok]
    return {"ok": not reasons, "reasons": reasons}
