"""What one ``stage bench compare`` run does: which deployments, which cores each process gets, which
workloads, which SLO. Frozen, validated at construction; each error names the flag to change. Pure: no
I/O (the ``stage`` parser imports this module).

The default split of a 2-core machine (``DEFAULT_PINNING``; ``--pin ROLE=CORES`` changes one role):
every deployment gets the same two cores, and the client, the router and Redis are on core 0 in all
of them, so the client's path and its CPU are the same everywhere. The model's processes are placed
as an operator of this machine would place them: colocated, the one server on core 1 (one torch
thread: it has one engine thread, and core 0 is the client's and the router's); 1P1D, the decode alone
on core 1 (the stage that is busy for every token) and the prefill on core 0; 1E1P1D, the decode
alone on core 1, the encoder and the prefill on core 0. So the comparison is *the same machine*, not
*the same model compute*: the disaggregated stacks may use core 0's spare time, which the colocated
server cannot (``analysis.py`` reports the work per core so both readings are possible).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from bench.serve.config import Load, Mix, Slo
from stages.config import TRANSFERS

DEPLOYMENTS = ("colocated", "pd", "epd")  # ``stage up`` modes; the ratios are against colocated
PIN_ROLES = ("client", "router", "redis", "colocated", "encoder", "prefill", "decode")
DEFAULT_PINNING: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("client", (0,)), ("router", (0,)), ("redis", (0,)),
    ("colocated", (1,)), ("encoder", (0,)), ("prefill", (0,)), ("decode", (1,)))
SINGLE = "single"  # the low-load workload: one request at a time (the E2E goal)
ENCODE_HEAVY = "encode_heavy"  # the TPOT and goodput goals
WORKLOAD_NAMES = (SINGLE, ENCODE_HEAVY, "text_only", "repeated_images")
DEFAULT_RATES = ((ENCODE_HEAVY, 1.0), ("text_only", 2.0), ("repeated_images", 1.0))
DEFAULT_SLO = Slo(ttft_ms=2000.0, tpot_ms=50.0)


@dataclass(frozen=True)
class Pinning:
    """The cores of each process role (``PIN_ROLES``): ``client`` is this process."""

    cores: tuple[tuple[str, tuple[int, ...]], ...] = DEFAULT_PINNING

    def __post_init__(self) -> None:
        roles = [role for role, _ in self.cores]
        if sorted(roles) != sorted(PIN_ROLES):
            raise ValueError(f"--pin: give each of {', '.join(PIN_ROLES)} once, got {', '.join(roles)}")
        for role, cores in self.cores:
            if not cores or any(core < 0 for core in cores):
                raise ValueError(f"--pin {role}: give one or more core numbers >= 0, got {list(cores)}")

    def of(self, role: str) -> tuple[int, ...]:
        return dict(self.cores)[role]

    def overridden(self, items: dict[str, tuple[int, ...]]) -> Pinning:
        """These roles on other cores (``--pin ROLE=CORES``); unknown roles are refused by name."""
        unknown = sorted(set(items) - set(PIN_ROLES))
        if unknown:
            raise ValueError(f"--pin: unknown role {', '.join(unknown)} (roles: {', '.join(PIN_ROLES)})")
        return Pinning(tuple((role, tuple(items.get(role, cores))) for role, cores in self.cores))

    def all_cores(self) -> set[int]:
        return {core for _, cores in self.cores for core in cores}


@dataclass(frozen=True)
class Workload:
    """One workload of the run: the same requests (``mix``) arriving the same way (``load``) for every
    deployment. ``what`` says it in words (printed and kept in the JSON)."""

    name: str
    what: str
    mix: Mix
    load: Load


@dataclass(frozen=True)
class Sizing:
    """The knobs of the built-in workloads (``workloads``): requests per loaded workload and in the
    single-request probe, max_tokens, the image size, each loaded workload's Poisson rate, the seed."""

    num_requests: int = 24
    single_requests: int = 5
    output_len: int = 32
    image_size: tuple[int, int] = (448, 448)
    rates: tuple[tuple[str, float], ...] = DEFAULT_RATES
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.single_requests < 1:
            raise ValueError("--num-requests and --single-requests must be >= 1")
        if self.output_len < 2:
            raise ValueError(f"--output-len must be >= 2 (TPOT needs two tokens), got {self.output_len}")
        unknown = sorted(set(dict(self.rates)) - set(WORKLOAD_NAMES[1:]))
        if unknown:
            raise ValueError(f"--rates: unknown workload {', '.join(unknown)} (loaded workloads: "
                             f"{', '.join(WORKLOAD_NAMES[1:])})")
        if any(not (rate > 0 and math.isfinite(rate)) for _, rate in self.rates):
            raise ValueError(f"--rates: each rate must be a finite number > 0, got {dict(self.rates)}")

    def rate(self, name: str) -> float:
        return dict(DEFAULT_RATES, **dict(self.rates))[name]


def workloads(sizing: Sizing) -> tuple[Workload, ...]:
    """The built-in workloads, in run order (each with its own seed, so no image repeats across them):

    - ``single``: one request at a time, each with one new image and a short question (low load: the
      E2E goal);
    - ``encode_heavy``: a quarter of the requests carry three new large images, the rest are short
      text turns; Poisson arrivals;
    - ``text_only``: text turns of ~64 words; Poisson arrivals;
    - ``repeated_images``: one image per request, 85% of them an image sent before (cache hits in
      EPD); Poisson arrivals."""
    size = ((sizing.image_size, 1.0),)
    out, n = sizing.output_len, sizing.num_requests

    def poisson(name: str) -> Load:
        return Load(request_rate=sizing.rate(name), seed=sizing.seed)

    w, h = sizing.image_size
    return (
        Workload(SINGLE, f"one request at a time: 1 new {w}x{h} image + ~16 words, {out} tokens",
                 Mix(num_requests=sizing.single_requests, images_per_request=((1, 1.0),), image_sizes=size,
                     input_len=16, output_len=out, seed=sizing.seed * 10 + 1),
                 Load(request_rate=math.inf, max_concurrency=1, seed=sizing.seed)),
        Workload(ENCODE_HEAVY, f"~25% of requests (drawn) with 3 new {w}x{h} images, 75% ~16-word text turns; "
                 f"{out} tokens; Poisson {sizing.rate(ENCODE_HEAVY):g}/s",
                 Mix(num_requests=n, images_per_request=((0, 0.75), (3, 0.25)), image_sizes=size,
                     input_len=16, output_len=out, seed=sizing.seed * 10 + 2), poisson(ENCODE_HEAVY)),
        Workload("text_only", f"text only, ~64 words; {out} tokens; Poisson {sizing.rate('text_only'):g}/s",
                 Mix(num_requests=n, images_per_request=((0, 1.0),), input_len=64, output_len=out,
                     seed=sizing.seed * 10 + 3), poisson("text_only")),
        Workload("repeated_images", f"1 {w}x{h} image per request, 85% of them sent before; ~16 words; "
                 f"{out} tokens; Poisson {sizing.rate('repeated_images'):g}/s",
                 Mix(num_requests=n, images_per_request=((1, 1.0),), image_sizes=size, repeat_image_share=0.85,
                     input_len=16, output_len=out, seed=sizing.seed * 10 + 4), poisson("repeated_images")),
    )


def select(all_workloads: tuple[Workload, ...], names: tuple[str, ...]) -> tuple[Workload, ...]:
    """The workloads named (``--workloads``), in run order; unknown names are refused."""
    unknown = sorted(set(names) - {w.name for w in all_workloads})
    if unknown:
        raise ValueError(f"--workloads: unknown {', '.join(unknown)} (known: {', '.join(WORKLOAD_NAMES)})")
    return tuple(w for w in all_workloads if w.name in names)


@dataclass(frozen=True)
class CompareConfig:
    """One run: ``deployments`` one after the other (each a fresh ``stage up`` stack behind the router),
    each driven with every workload in order; the whole sequence ``rounds`` times, reversed every other
    round (``pool.py``). ``threads``: torch threads of every stage server."""

    model: Path
    out: Path
    deployments: tuple[str, ...] = DEPLOYMENTS
    workloads: tuple[Workload, ...] = field(default_factory=lambda: workloads(Sizing()))
    slo: Slo = DEFAULT_SLO
    pinning: Pinning = Pinning()
    transfer: str = "mooncake"
    threads: int = 1
    rounds: int = 2
    request_timeout_s: float = 300.0
    startup_timeout_s: float = 300.0
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.deployments or len(set(self.deployments)) != len(self.deployments):
            raise ValueError(f"--deployments: give each deployment at most once, got {list(self.deployments)}")
        unknown = sorted(set(self.deployments) - set(DEPLOYMENTS))
        if unknown:
            raise ValueError(f"--deployments: unknown {', '.join(unknown)} (known: {', '.join(DEPLOYMENTS)})")
        if "colocated" not in self.deployments:
            raise ValueError("--deployments must include colocated: every ratio is against it")
        if not self.workloads:
            raise ValueError("--workloads: give at least one workload")
        if not self.slo.given():
            raise ValueError("--slo: give at least one objective (goodput counts the requests that meet them)")
        if self.transfer not in TRANSFERS:
            raise ValueError(f"--transfer must be one of {', '.join(TRANSFERS)}, got {self.transfer!r}")
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")
        for name in ("request_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")

    def order(self, round_index: int) -> tuple[str, ...]:
        """The deployments of round ``round_index`` (from 0): as given, reversed every other round."""
        return self.deployments if round_index % 2 == 0 else self.deployments[::-1]
