"""The configs of one ``stage bench serve`` run: frozen, validated at construction; each error names the
flag to change. Pure: no I/O, no heavy imports (the ``stage`` parser imports this module)."""

from __future__ import annotations

import math
from dataclasses import dataclass

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")


@dataclass(frozen=True)
class Mix:
    """The seeded synthetic multimodal workload.

    ``images_per_request``: (count, weight) pairs, one count drawn per request. ``image_sizes``:
    ((width, height), weight) pairs, one drawn per new image. ``repeat_image_share``: the chance that an
    image slot reuses an image an earlier slot already sent (the same bytes, so a cache can hit) instead
    of a new one. Prompt words and ``max_tokens`` are drawn uniformly in ``len * [1 - range_ratio, 1 +
    range_ratio]`` (vllm's random dataset's rule)."""

    num_requests: int = 100
    images_per_request: tuple[tuple[int, float], ...] = ((0, 0.3), (1, 0.5), (2, 0.2))
    image_sizes: tuple[tuple[tuple[int, int], float], ...] = (((224, 224), 0.5), ((448, 448), 0.5))
    repeat_image_share: float = 0.0
    input_len: int = 64
    output_len: int = 64
    range_ratio: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        _check_weights("--images-per-request", self.images_per_request)
        if any(count < 0 for count, _ in self.images_per_request):
            raise ValueError("--images-per-request: image counts must be >= 0")
        _check_weights("--image-sizes", self.image_sizes)
        if any(w < 1 or h < 1 for (w, h), _ in self.image_sizes):
            raise ValueError("--image-sizes: width and height must be >= 1")
        if not 0.0 <= self.repeat_image_share <= 1.0:
            raise ValueError(f"--repeat-image-share must be in [0, 1], got {self.repeat_image_share}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")


@dataclass(frozen=True)
class Load:
    """How requests arrive: at ``request_rate`` per second (``inf``: all at once) with gaps drawn from a
    gamma distribution of shape ``burstiness`` (1: Poisson; < 1 burstier; > 1 more even; inf: evenly
    spaced), and at most
    ``max_concurrency`` in flight (None: no cap)."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in ms; a request is *good* when it completed and meets every one given."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for key in SLO_KEYS:
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"--slo {key} must be > 0, got {value}")

    def given(self) -> dict[str, float]:
        return {key: getattr(self, key) for key in SLO_KEYS if getattr(self, key) is not None}


@dataclass(frozen=True)
class Target:
    """Where requests go: ``url`` (the server root, e.g. http://127.0.0.1:8000) + ``endpoint``; the
    ``model`` name sent; each request's deadline; the sampling fields every body gets."""

    url: str
    model: str
    endpoint: str = "/v1/chat/completions"
    request_timeout_s: float = 600.0
    temperature: float = 0.0
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")
        if not self.endpoint.startswith("/"):
            raise ValueError(f"--endpoint must start with '/', got {self.endpoint!r}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout-s must be > 0, got {self.request_timeout_s}")

    @property
    def chat_url(self) -> str:
        return self.url.rstrip("/") + self.endpoint


def _check_weights(flag: str, pairs: tuple) -> None:
    if not pairs:
        raise ValueError(f"{flag}: give at least one value")
    if any(weight < 0 for _, weight in pairs) or not sum(weight for _, weight in pairs) > 0:
        raise ValueError(f"{flag}: weights must be >= 0 and sum to more than 0")


# --- flag parsing (pure; ValueError names the flag) --------------------------------------------
def parse_weighted(flag: str, text: str, parse_value) -> tuple:
    """``"A:w,B:w"`` (a value without ``:w`` weighs 1) -> ((parse_value(A), w), ...)."""
    pairs = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        value, _, weight = part.partition(":")
        try:
            pairs.append((parse_value(value.strip()), float(weight) if weight else 1.0))
        except ValueError:
            raise ValueError(f"{flag}: cannot read {part!r} (expected VALUE or VALUE:WEIGHT)") from None
    return tuple(pairs)


def parse_size(text: str) -> tuple[int, int]:
    """``"448x448"`` -> (448, 448)."""
    width, sep, height = text.lower().partition("x")
    if not sep:
        raise ValueError(text)
    return int(width), int(height)


def parse_slo(text: str | None) -> Slo:
    """``"ttft_ms=500,tpot_ms=50"`` -> Slo; keys are ttft_ms, tpot_ms, e2el_ms."""
    values: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo: cannot read {part!r} (expected KEY=MS with KEY one of {', '.join(SLO_KEYS)})")
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {key} must be a number of ms, got {value!r}") from None
    return Slo(**values)


def parse_rates(text: str) -> tuple[float, ...]:
    """``"1,2,inf"`` -> (1.0, 2.0, inf), for --sweep."""
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--sweep: cannot read {text!r} (expected request rates like 1,2,4)") from None
    if not rates or any(not rate > 0 for rate in rates):
        raise ValueError(f"--sweep: give request rates > 0, got {text!r}")
    return rates
