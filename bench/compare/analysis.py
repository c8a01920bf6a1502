"""From the measured results to the answers: ratios against colocated, the work each core did per
request, and the issue's three goals, each with the facts that explain it. Pure.

Input: ``results`` = mode -> {"placed": role -> {"cores"}, "workloads": name -> result}, where a result
is ``session.run_workload``'s dict (``bench.serve`` keys plus ``probe``).

Work per core: the CPU seconds of every process pinned to a core (the client's too), per completed
request. CPU seconds are work done, not time waited, so they stay put when other load shares the core;
1000 / (the busiest core's ms per request) is the most requests per second that placement could
serve with the cores to itself (``capacity_rps``). Busy seconds are the stages' own
(``epd_engine_step_seconds_sum``, ``epd_encoder_seconds_sum``).
"""

from __future__ import annotations

from bench.compare.config import ENCODE_HEAVY, SINGLE

METRICS = (("ttft_p50", "median_ttft_ms"), ("ttft_p99", "p99_ttft_ms"), ("tpot_p50", "median_tpot_ms"),
           ("tpot_p99", "p99_tpot_ms"), ("goodput", "request_goodput"), ("e2e_p50", "median_e2el_ms"),
           ("e2e_p99", "p99_e2el_ms"))
TPOT_GOAL, GOODPUT_GOAL, E2E_GOAL = 0.5, 2.0, 1.10
STAGE_ROLES = ("colocated", "encoder", "prefill", "decode")


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base, rounded; None when either is missing or base is 0."""
    if value is None or base is None or base == 0:
        return None
    return round(value / base, 3)


def ratios(results: dict[str, dict]) -> dict[str, dict[str, dict[str, float | None]]]:
    """mode -> workload -> metric (``METRICS``) -> mode's value / colocated's, for every mode but
    colocated and every workload both measured."""
    base = results["colocated"]["workloads"]
    out: dict = {}
    for mode, deployment in results.items():
        if mode == "colocated":
            continue
        out[mode] = {name: {metric: ratio(result[key], base[name][key]) for metric, key in METRICS}
                     for name, result in deployment["workloads"].items() if name in base}
    return out


def stage_work(result: dict, placed: dict[str, dict], client_cores: tuple[int, ...]) -> dict:
    """Per role: CPU and busy seconds, each per completed request, the busy fraction of the run and the
    unit costs its counters give (``unit_costs``); per core (the cores' numbers joined by '+'): the CPU
    ms per request of every process on it; the busiest core and ``capacity_rps``."""
    probe, n = result["probe"], result["completed"]
    wall = probe["machine"]["wall_s"]
    cpu_by_role = {role: r["cpu_s"] for role, r in probe["roles"].items() if "cpu_s" in r}
    cpu_by_role["client"] = probe["machine"]["client_cpu_s"]
    roles: dict[str, dict] = {}
    for role, cpu in cpu_by_role.items():
        series = probe["roles"].get(role, {}).get("series", {})
        busy = series.get("epd_engine_step_seconds_sum", series.get("epd_encoder_seconds_sum"))
        roles[role] = {"cpu_s": cpu, "cpu_ms_per_request": _per(cpu * 1e3, n),
                       "busy_s": None if busy is None else round(busy, 3),
                       "busy_ms_per_request": None if busy is None else _per(busy * 1e3, n),
                       "busy_fraction": None if busy is None or not wall else round(busy / wall, 3),
                       **unit_costs(role, series, cpu)}
    cores: dict[str, float] = {}
    for role, cpu in cpu_by_role.items():
        key = "+".join(map(str, client_cores if role == "client" else placed[role]["cores"]))
        cores[key] = cores.get(key, 0.0) + cpu
    per_core = {core: {"cpu_s": round(cpu, 3), "cpu_ms_per_request": _per(cpu * 1e3, n),
                       "cpu_share": round(cpu / wall, 3) if wall else None} for core, cpu in sorted(cores.items())}
    busiest = max(per_core, key=lambda core: per_core[core]["cpu_ms_per_request"] or 0.0)
    demand = per_core[busiest]["cpu_ms_per_request"]
    return {"roles": roles, "cores": per_core, "busiest_core": busiest,
            "capacity_rps": round(1e3 / demand, 3) if demand else None}


def unit_costs(role: str, series: dict[str, float], cpu_s: float) -> dict[str, float]:
    """What one unit of work cost a stage, from its counters: busy ms (the stage's own step or call
    timing: wall time, so it grows when other processes share the core) and CPU ms (its process's CPU
    seconds, HTTP and transfer included: work done, which does not). The encoder's per image; a
    prefill's per 1000 prompt tokens (a PD prefill's include encoding the images); an engine's
    (decode, colocated) per step and per output token, and output tokens per step (the mean batch).
    ``cpu_of_busy``: CPU seconds over busy seconds (well below 1: the stage waited for its core)."""
    out: dict[str, float] = {}
    images = series.get("epd_encoder_images_encoded_total")
    steps, busy = series.get("epd_engine_step_seconds_count"), series.get("epd_engine_step_seconds_sum")
    prompt, generated = series.get("epd_prompt_tokens_total"), series.get("epd_generation_tokens_total")
    if images:
        busy = series["epd_encoder_seconds_sum"]
        out.update(ms_per_image=round(busy * 1e3 / images, 2), cpu_ms_per_image=round(cpu_s * 1e3 / images, 2))
    if role == "prefill" and prompt and busy is not None:
        out.update(ms_per_1k_prompt_tokens=round(busy * 1e6 / prompt, 1),
                   cpu_ms_per_1k_prompt_tokens=round(cpu_s * 1e6 / prompt, 1))
    if role in ("decode", "colocated") and steps and busy is not None:
        out.update(ms_per_step=round(busy * 1e3 / steps, 2), tokens_per_step=round((generated or 0.0) / steps, 2))
        if role == "decode" and generated:
            out["cpu_ms_per_output_token"] = round(cpu_s * 1e3 / generated, 2)
    if busy:
        out["cpu_of_busy"] = round(cpu_s / busy, 3)
    return out


def all_stage_work(results: dict[str, dict], client_cores: tuple[int, ...]) -> dict:
    """``stage_work`` of every mode and workload."""
    return {mode: {name: stage_work(result, deployment["placed"], client_cores)
                   for name, result in deployment["workloads"].items()} for mode, deployment in results.items()}


def goals(results: dict[str, dict], work: dict) -> list[dict]:
    """The issue's goals for each disaggregated mode, where the workloads they need were run:
    TPOT p99 on encode_heavy <= 0.5x colocated; goodput on encode_heavy >= 2x; E2E (median) of one
    request at a time (``single``) <= 1.10x. Each: goal, mode, ratio, target, met, facts, why."""
    out = []
    base = results["colocated"]["workloads"]
    for mode, deployment in results.items():
        if mode == "colocated":
            continue
        mine = deployment["workloads"]
        if ENCODE_HEAVY in mine and ENCODE_HEAVY in base:
            out.append(_tpot_goal(mode, mine[ENCODE_HEAVY], base[ENCODE_HEAVY], work))
            out.append(_goodput_goal(mode, mine[ENCODE_HEAVY], base[ENCODE_HEAVY], work))
        if SINGLE in mine and SINGLE in base:
            out.append(_e2e_goal(mode, mine[SINGLE], base[SINGLE], work))
    return out


def _tpot_goal(mode: str, mine: dict, base: dict, work: dict) -> dict:
    value = ratio(mine["p99_tpot_ms"], base["p99_tpot_ms"])
    roles = work[mode][ENCODE_HEAVY]["roles"]
    decode, engine = roles["decode"], work["colocated"][ENCODE_HEAVY]["roles"]["colocated"]
    floor = ratio(decode.get("ms_per_step"), base["p99_tpot_ms"])
    facts = {"colocated_p99_tpot_ms": base["p99_tpot_ms"], "p99_tpot_ms": mine["p99_tpot_ms"],
             "decode_ms_per_step": decode.get("ms_per_step"), "colocated_ms_per_step": engine.get("ms_per_step"),
             "encoder_ms_per_image": roles.get("encoder", {}).get("ms_per_image"),
             "prefill_ms_per_1k_prompt_tokens": roles["prefill"].get("ms_per_1k_prompt_tokens"),
             "decode_cpu_of_busy": decode.get("cpu_of_busy"), "colocated_cpu_of_busy": engine.get("cpu_of_busy"),
             "ratio_floor": floor}
    encode = (f"the encoder {facts['encoder_ms_per_image']} ms per image, " if "encoder" in roles
              else "")
    why = (f"{mode}'s decode runs only decode steps ({decode.get('ms_per_step')} ms each on average); colocated's "
           f"engine averaged {engine.get('ms_per_step')} ms per step, because the step that takes in an image "
           f"request also encodes its images and prefills its prompt ({mode}: {encode}the prefill "
           f"{facts['prefill_ms_per_1k_prompt_tokens']} ms per 1000 prompt tokens) while every running request "
           f"waits: p99 TPOT {_ms(base['p99_tpot_ms'])} ms colocated vs {_ms(mine['p99_tpot_ms'])} ms. The ratio "
           f"cannot go below {floor} (a decode step over colocated's p99 TPOT). While busy, the decode's process ran "
           f"{decode.get('cpu_of_busy')} of the time, colocated's {engine.get('cpu_of_busy')} (1 = its core to itself)")
    return _goal("tpot_p99_encode_heavy", mode, value, TPOT_GOAL, value is not None and value <= TPOT_GOAL,
                 facts, why)


def _goodput_goal(mode: str, mine: dict, base: dict, work: dict) -> dict:
    value = ratio(mine["request_goodput"], base["request_goodput"])
    total = base["completed"] + base["failed"]
    ceiling = ratio(total, base["good_requests"])
    cap, cap_base = work[mode][ENCODE_HEAVY]["capacity_rps"], work["colocated"][ENCODE_HEAVY]["capacity_rps"]
    facts = {"good_requests": mine["good_requests"], "colocated_good_requests": base["good_requests"],
             "requests": total, "ceiling_at_this_rate": ceiling, "capacity_rps": cap,
             "colocated_capacity_rps": cap_base,
             "capacity_ratio": ratio(cap, cap_base), "busiest_core": work[mode][ENCODE_HEAVY]["busiest_core"],
             "colocated_busiest_core": work["colocated"][ENCODE_HEAVY]["busiest_core"]}
    cap_text = (f"by CPU work per request, colocated's busiest core (core {facts['colocated_busiest_core']}) allows "
                f"{cap_base} req/s, {mode}'s (core {facts['busiest_core']}) {cap} req/s: {facts['capacity_ratio']}x")
    if not base["good_requests"]:
        why = (f"colocated met the SLO on none of the {total} requests at this rate ({mode}: {mine['good_requests']}), "
               f"so the ratio has no value: lower the rate (--rates) or loosen --slo to compare; {cap_text}")
    else:
        why = (f"at one offered rate goodput is the good share of the same requests: {mine['good_requests']} of "
               f"{total} good vs colocated's {base['good_requests']}, so this rate caps the ratio at {ceiling}; "
               f"{cap_text}")
    return _goal("goodput_encode_heavy", mode, value, GOODPUT_GOAL, value is not None and value >= GOODPUT_GOAL,
                 facts, why)


def _e2e_goal(mode: str, mine: dict, base: dict, work: dict) -> dict:
    value = ratio(mine["median_e2el_ms"], base["median_e2el_ms"])
    router = mine["probe"]["roles"].get("router", {}).get("series", {})
    n = mine["completed"]
    calls = {}
    for stage in ("encoder", "prefill", "decode"):
        seconds = router.get(f"epd_router_stage_seconds_sum{{stage={stage}}}")
        count = router.get(f"epd_router_stage_seconds_count{{stage={stage}}}")
        if count:
            calls[stage] = round(seconds * 1e3 / count, 1)
    kv = mine["probe"]["roles"].get("prefill", {}).get("series", {}).get("epd_kv_transfer_seconds")
    busy = {r: w["busy_ms_per_request"] for r, w in work[mode][SINGLE]["roles"].items() if w["busy_ms_per_request"]}
    facts = {"median_e2el_ms": mine["median_e2el_ms"], "colocated_median_e2el_ms": base["median_e2el_ms"],
             "router_stage_call_ms": calls, "kv_write_ms_per_request": _per(kv * 1e3, n) if kv is not None else None,
             "busy_ms_per_request": busy,
             "colocated_busy_ms_per_request": work["colocated"][SINGLE]["roles"]["colocated"]["busy_ms_per_request"]}
    extra = "n/a" if value is None else f"{mine['median_e2el_ms'] - base['median_e2el_ms']:+.1f}"
    why = (f"one request at a time: {_ms(mine['median_e2el_ms'])} ms vs colocated's {_ms(base['median_e2el_ms'])} ms "
           f"({extra} ms); the stages' own busy ms per request "
           f"{busy} vs colocated's {facts['colocated_busy_ms_per_request']}; the router's calls (sent to last "
           f"byte) {calls} ms; KV writes {facts['kv_write_ms_per_request']} ms per request. What {mode} adds "
           f"is the hand-offs between processes (HTTP, {'Redis, ' if 'encoder' in busy else ''}KV transfer) and "
           f"the waits of processes that share a core (per core: {work[mode][SINGLE]['cores']})")
    return _goal("e2e_single_request", mode, value, E2E_GOAL, value is not None and value <= E2E_GOAL, facts, why)


def _goal(name: str, mode: str, value: float | None, target: float, met: bool, facts: dict, why: str) -> dict:
    return {"goal": name, "mode": mode, "ratio": value, "target": target, "met": met, "facts": facts, "why": why}


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _per(total: float, n: int) -> float | None:
    return round(total / n, 2) if n else None
