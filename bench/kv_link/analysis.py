"""The numbers of a cell from its timings: each path's median / p90 / min time and GB/s (1 GB = 1e9
B; ``bench.kv_transfer.analysis.summarize``), the bandwidth ratios ours / tcp, raw / tcp and ours /
raw (time of the reference over the path's, at the medians), the limit when ours / tcp misses the
goal, whether each path's bytes crossed the link, and the goal over all cells. Pure; tested in
tests/bench/test_kv_link.py."""

from __future__ import annotations

from bench.kv_transfer.analysis import summarize

GOAL_RATIO = 0.8  # ours / raw TCP, bandwidth at the median
LAYER_RATIO = 0.9  # ours / raw library at or above this: our layer is not what holds ours back
__all__ = ["GOAL_RATIO", "LAYER_RATIO", "cell_ratios", "crossed_link", "goal", "limit", "summarize"]


def _ratio(res: dict[str, dict], reference: str, path: str, key: str = "median_ms") -> float:
    return round(res[reference][key] / res[path][key], 3)


def cell_ratios(res: dict[str, dict]) -> dict:
    """From a cell's path summaries (``ours``, ``raw``, ``tcp``): ``ours_vs_tcp``, ``raw_vs_tcp``,
    ``ours_vs_raw`` (medians), the same three of the minima (``*_best``), and ``limit``."""
    out = {"ours_vs_tcp": _ratio(res, "tcp", "ours"), "raw_vs_tcp": _ratio(res, "tcp", "raw"),
           "ours_vs_raw": _ratio(res, "raw", "ours"),
           "ours_vs_tcp_best": _ratio(res, "tcp", "ours", "min_ms"),
           "raw_vs_tcp_best": _ratio(res, "tcp", "raw", "min_ms"),
           "ours_vs_raw_best": _ratio(res, "raw", "ours", "min_ms")}
    out["limit"] = limit(out["ours_vs_tcp"], out["raw_vs_tcp"], out["ours_vs_raw"])
    return out


def limit(ours_vs_tcp: float, raw_vs_tcp: float, ours_vs_raw: float) -> str | None:
    """Why ours / tcp misses ``GOAL_RATIO`` (None when it does not), from the two factors it is the
    product of: the library's own path (raw / tcp short of ``GOAL_RATIO``) and our layer (ours / raw
    short of ``LAYER_RATIO``): ``library``, ``our layer``, ``library and our layer``, or ``neither
    alone`` when each is within its margin and only their product falls short."""
    if ours_vs_tcp >= GOAL_RATIO:
        return None
    library, layer = raw_vs_tcp < GOAL_RATIO, ours_vs_raw < LAYER_RATIO
    if library and layer:
        return "library and our layer"
    return "library" if library else "our layer" if layer else "neither alone"


def crossed_link(wire_bytes: int, payload: int, tcp_opens: int = 0) -> dict:
    """What the source's link sent during one move of ``payload`` bytes: ``wire_ratio`` (bytes sent /
    payload), ``over_link`` (at least the payload went out: the path used the network, not memory
    shared between the two namespaces) and ``tcp_opens``, the TCP connections the source opened
    for it (0 for a path that keeps its connections)."""
    ratio = wire_bytes / payload if payload else 0.0
    return {"wire_bytes": wire_bytes, "wire_ratio": round(ratio, 3), "over_link": ratio >= 1.0,
            "tcp_opens": tcp_opens}


def goal(results: list[dict]) -> dict:
    """ours / tcp of every cell (``backend/<MiB>MiB/layout``), whether all reach ``GOAL_RATIO`` with
    every path over the link, those below with their limit, and the cells a path of which did not
    cross the link."""
    ratios, below, off_link = {}, {}, []
    for result in results:
        for cell in result["cells"]:
            key = f"{result['backend']}/{cell['mib']}MiB/{cell['layout']}"
            ratios[key] = cell["ours_vs_tcp"]
            if cell["ours_vs_tcp"] < GOAL_RATIO:
                below[key] = {"ours_vs_tcp": cell["ours_vs_tcp"], "raw_vs_tcp": cell["raw_vs_tcp"],
                              "ours_vs_raw": cell["ours_vs_raw"], "limit": cell["limit"]}
            off_link += [f"{key}/{p}" for p, w in cell["wire"].items() if not w["over_link"]]
    return {"ours_vs_tcp": GOAL_RATIO, "ratios": ratios, "met": not below and not off_link, "below": below,
            "not_over_link": off_link}
