"""The recorded load the fake workers publish: a deterministic counter trajectory per worker, and the
Prometheus text of it as a stage publishes its ``/metrics``. Pure.

Phases of ``PHASE_S`` seconds alternate: image-heavy (the encoders busy, long prompts) then text-only
(no images; shorter prompts, as many decoded tokens). Each worker's rate is its role's in the phase
times a fixed per-worker spread (``jitter``), so no two workers count alike; a worker's capacity
(units per busy second) is its role's, spread the same way.
"""

from __future__ import annotations

import math

PHASE_S = 20.0
ROLES = ("encoder", "prefill", "decode")
# units per second of one worker, per phase (image-heavy, text-only): images, prompt tokens, generated tokens
RATES = {"encoder": (4.0, 0.0), "prefill": (3000.0, 1200.0), "decode": (150.0, 150.0)}
VIDEO_SHARE = 0.25  # of the encoder's units: video frames
CAPACITY = {"encoder": 40.0, "prefill": 12000.0, "decode": 400.0}  # units per busy second
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MODEL = "fake-model"


def jitter(index: int) -> float:
    """A worker's fixed spread around its role's rate: 0.8 to 1.2, from its index."""
    return 0.8 + 0.4 * ((index * 0.6180339887) % 1.0)


def integral(role: str, t: float) -> float:
    """Units of one worker of ``role`` at rate 1x from 0 to ``t`` seconds (the phases' rates integrated)."""
    heavy, light = RATES[role]
    whole, part = divmod(max(t, 0.0), 2 * PHASE_S)
    return whole * PHASE_S * (heavy + light) + min(part, PHASE_S) * heavy + max(0.0, part - PHASE_S) * light


def counters(role: str, index: int, t: float) -> dict[str, float]:
    """The cumulative counters and gauges of worker ``index`` of ``role`` at ``t`` seconds into the load."""
    k = jitter(index)
    units = integral(role, t) * k
    busy = units / (CAPACITY[role] * k)
    phase_heavy = (t % (2 * PHASE_S)) < PHASE_S
    rate = RATES[role][0 if phase_heavy else 1] * k
    return {"units": units, "busy_s": busy, "steps": math.floor(busy / 0.02),
            "queue": float(round(rate / CAPACITY[role] * 4)), "running": float(round(rate / CAPACITY[role] * 8))}


def metrics_text(role: str, index: int, t: float) -> str:
    """The worker's ``/metrics`` body at ``t``: the series ``router.fleet.load.parse_sample`` reads (under
    the names the stages publish), a step-time histogram with its buckets, and a few gauges beside them."""
    c = counters(role, index, t)
    lines: list[str] = []

    def family(name: str, kind: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {name.replace('_', ' ')}.")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{series} {value!r}" for series, value in samples)

    def histogram(name: str, total_s: float, count: int) -> None:
        mean = total_s / count if count else 0.0
        samples = [(f'{name}_bucket{{le="{b}"}}', float(count if mean <= b else 0)) for b in BUCKETS]
        samples += [(f'{name}_bucket{{le="+Inf"}}', float(count)), (f"{name}_count", float(count)),
                    (f"{name}_sum", total_s)]
        family(name, "histogram", samples)

    if role == "encoder":
        video = c["units"] * VIDEO_SHARE
        histogram("epd_encoder_seconds", c["busy_s"], c["steps"])
        family("epd_encoder_images_encoded_total", "counter", [("epd_encoder_images_encoded_total", c["units"] - video)])
        family("epd_encoder_video_frames_encoded_total", "counter",
               [("epd_encoder_video_frames_encoded_total", video)])
        family("epd_encoder_queue_depth", "gauge", [("epd_encoder_queue_depth", c["queue"])])
    else:
        histogram("epd_engine_step_seconds", c["busy_s"], c["steps"])
        prompt = c["units"] if role == "prefill" else c["units"] * 4
        generated = c["units"] if role == "decode" else c["units"] / 1000
        family("epd_prompt_tokens_total", "counter", [("epd_prompt_tokens_total", prompt)])
        family("epd_generation_tokens_total", "counter", [("epd_generation_tokens_total", generated)])
        family("epd_queue_depth", "gauge", [("epd_queue_depth", c["queue"])])
        family("epd_kv_blocks_used", "gauge", [("epd_kv_blocks_used", float(int(c["running"]) * 40))])
    family("epd_running_requests", "gauge", [("epd_running_requests", c["running"])])
    family("epd_requests_total", "counter",
           [(f'epd_requests_total{{outcome="{o}"}}', float(c["steps"] if o == "ok" else 0))
            for o in ("ok", "client_error", "rejected", "error")])
    return "\n".join(lines) + "\n"


def expected_need(role: str, indexes: range, start: float, end: float) -> float:
    """Workers' worth of busy time ``role``'s workers ``indexes`` took between ``start`` and ``end``
    (what the planner should measure: busy seconds over the span)."""
    busy = sum((integral(role, end) - integral(role, start)) / CAPACITY[role] for _ in indexes)
    return busy / (end - start)
