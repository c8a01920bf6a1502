"""Every figure the tables quote, from the recorded requests and split samples. Pure.

A request is ``{"phase", "kind", "send_s", "end_s", "ok", "ttft_s"?, "tpot_s"?}`` (seconds from its
configuration's start); a split sample ``{"t_s", "workers": [{"id", "role", "draining"}]}``."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence

from bench.common.stats import ratio
from bench.ratio_shift.workload import Phase

ROLES = ("encoder", "prefill", "decode")


def throughput(requests: Sequence[dict], seconds: float) -> float:
    """Requests answered (ok) per second."""
    return sum(1 for r in requests if r["ok"]) / seconds if seconds > 0 else 0.0


def slo_from(requests: Sequence[dict], factor: float) -> dict[str, float] | None:
    """The SLO: ``factor`` x the median TTFT and the median TPOT of the answered ``requests``; None if none."""
    ok = [r for r in requests if r["ok"]]
    if not ok:
        return None
    return {"ttft_s": round(factor * statistics.median(r["ttft_s"] for r in ok), 4),
            "tpot_s": round(factor * statistics.median(r["tpot_s"] for r in ok), 5), "factor": factor}


def meets(request: dict, slo: dict[str, float]) -> bool:
    """Answered, and within both the TTFT and the TPOT bound."""
    return bool(request["ok"]) and request["ttft_s"] <= slo["ttft_s"] and request["tpot_s"] <= slo["tpot_s"]


def goodput(requests: Sequence[dict], phases: Sequence[Phase], slo: dict[str, float]) -> dict[str, float]:
    """Requests meeting the SLO per second, per phase (those sent in it, over its duration) and
    ``overall`` (all over the phases' total)."""
    out = {}
    for p in phases:
        good = sum(meets(r, slo) for r in requests if r["phase"] == p.name)
        out[p.name] = round(good / p.duration_s, 3)
    total = sum(p.duration_s for p in phases)
    out["overall"] = round(sum(meets(r, slo) for r in requests) / total, 3) if total else 0.0
    return out


def split_of(sample: dict) -> dict[str, int]:
    """Workers per role in one sample (draining ones counted in the role they have)."""
    counts = Counter(w["role"] for w in sample.get("workers") or [])
    return {role: counts.get(role, 0) for role in ROLES}


def split_changes(samples: Sequence[dict]) -> list[dict]:
    """Each sample whose split differs from the one before: ``{"t_s", "from", "to"}``; samples
    without workers (a failed read) are skipped."""
    out, last = [], None
    for s in samples:
        if not s.get("workers"):
            continue
        split = split_of(s)
        if last is not None and split != last:
            out.append({"t_s": s["t_s"], "from": _text(last), "to": _text(split)})
        last = split
    return out


def _text(split: dict[str, int]) -> str:
    return ":".join(str(split[r]) for r in ROLES)


def rebalance_s(changes: Sequence[dict], phases: Sequence[Phase]) -> dict[str, dict[str, float | None]]:
    """Per phase after the first (each follows a shift of the load): seconds from the phase's start to
    the first and to the last split change within it (None: no change in that phase)."""
    out: dict[str, dict[str, float | None]] = {}
    for p in phases[1:]:
        inside = [c["t_s"] - p.start_s for c in changes if p.start_s <= c["t_s"] < p.end_s]
        out[p.name] = {"first_s": round(min(inside), 2) if inside else None,
                       "last_s": round(max(inside), 2) if inside else None}
    return out


def switch_windows(samples: Sequence[dict]) -> list[tuple[float, float]]:
    """The spans during which a switch was under way: from the sample before to a sample showing a
    draining worker or a new split."""
    out: list[tuple[float, float]] = []
    last_t, last_split = None, None
    for s in samples:
        if not s.get("workers"):
            continue
        split = split_of(s)
        busy = any(w.get("draining") for w in s["workers"]) or (last_split is not None and split != last_split)
        if busy and last_t is not None:
            if out and out[-1][1] >= last_t:
                out[-1] = (out[-1][0], s["t_s"])
            else:
                out.append((last_t, s["t_s"]))
        last_t, last_split = s["t_s"], split
    return out


def failures(requests: Sequence[dict], windows: Sequence[tuple[float, float]]) -> dict[str, int]:
    """Requests failed in all, requests in flight during a switch, and those that both failed and overlapped one."""
    def overlaps(r: dict) -> bool:
        return any(r["send_s"] < end and r["end_s"] > start for start, end in windows)

    return {"failed": sum(not r["ok"] for r in requests),
            "during_switch": sum(overlaps(r) for r in requests),
            "failed_during_switch": sum(not r["ok"] and overlaps(r) for r in requests)}


def median_of(requests: Sequence[dict], key: str, phase: str | None = None) -> float | None:
    """The median of ``key`` over the answered requests (of ``phase``, if given)."""
    values = [r[key] for r in requests if r["ok"] and (phase is None or r["phase"] == phase)]
    return round(statistics.median(values), 4) if values else None


def summarize(runs: dict[str, dict], fixed: Sequence[str], phases: Sequence[Phase], factor: float) -> dict:
    """From each configuration's ``{"requests", "samples"}``: the SLO (``factor`` x the medians of the
    fixed split with the highest answered throughput), every configuration's goodput per phase and
    overall, re-balance times, failures; the baseline (the fixed split with the highest overall
    goodput under that SLO) and each configuration's overall goodput over it."""
    total = sum(p.duration_s for p in phases)
    ran = [name for name in fixed if name in runs]
    if not ran:
        return {"error": "no fixed split ran"}
    slo_source = max(ran, key=lambda n: throughput(runs[n]["requests"], total))
    slo = slo_from(runs[slo_source]["requests"], factor)
    if slo is None:
        return {"error": f"{slo_source} answered nothing"}
    per: dict[str, dict] = {}
    for name, run in runs.items():
        reqs, changes = run["requests"], split_changes(run["samples"])
        per[name] = {"goodput": goodput(reqs, phases, slo), "requests": len(reqs),
                     "throughput": round(throughput(reqs, total), 3),
                     "met_slo": sum(meets(r, slo) for r in reqs),
                     "ttft_median_s": {p.name: median_of(reqs, "ttft_s", p.name) for p in phases},
                     "tpot_median_s": median_of(reqs, "tpot_s"),
                     "changes": changes, "rebalance_s": rebalance_s(changes, phases),
                     **failures(reqs, switch_windows(run["samples"]))}
    baseline = max(ran, key=lambda n: per[n]["goodput"]["overall"])
    for name in per:
        per[name]["vs_best_fixed"] = {key: ratio(value, per[baseline]["goodput"][key])
                                      for key, value in per[name]["goodput"].items()}
    return {"slo": slo, "slo_source": slo_source, "best_fixed": baseline, "configs": per}


def goals(summary: dict, judged: Sequence[str], target: float) -> dict:
    """Goal: the best of ``judged`` at >= ``target`` x the best fixed split's overall goodput; none failed."""
    configs = summary.get("configs") or {}
    ratios = {n: configs[n]["vs_best_fixed"]["overall"] for n in judged if n in configs}
    best = max((v for v in ratios.values() if v is not None), default=None)
    return {"overall_goodput_vs_best_fixed": ratios, "target": target,
            "met": best is not None and best >= target,
            "no_failures": all(c["failed"] == 0 for c in configs.values()) if configs else None}
