"""Whether each role can run on this machine, from the facts alone (pure: no I/O, no torch).

    verdicts(facts, device="auto", transfers=TRANSFERS) -> tuple[Verdict, ...]   (encoder, prefill, decode)
    resolve_device(spec, gpus) -> (device, problem)

What each role needs, on the device ``--device`` resolves to (auto: cuda:0 when torch sees a GPU):
- every role: torch importing, transformers installed, the device present;
- encoder: the Redis of ``--redis-url`` answering (not checked when none is given: ``stage up`` starts one);
- prefill: one of ``transfers`` that imports and, on a GPU, can register GPU memory; the Redis if one is
  given (in EPD mode it reads the embeddings there);
- decode: one of ``transfers``, as the prefill.

A problem is one line that says what is missing and how to get it. A role with one working transfer is
ok; what is wrong with the other is a note.
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.envcheck.facts import Backend, Facts
from transfer.builds import MOONCAKE_BUILDS, NIXL_BUILDS

ROLES = ("encoder", "prefill", "decode")
TRANSFERS = ("mooncake", "nixl")
SETUP = "rerun scripts/setup.sh"


@dataclass(frozen=True)
class Verdict:
    """``ok``: the role can run here (``problems`` empty). ``transfers``: the backends that work for it
    (prefill, decode). ``notes``: what does not stop it (a second backend that cannot, Redis unchecked)."""

    role: str
    ok: bool
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    transfers: tuple[str, ...] = ()


def resolve_device(spec: str, gpus: int) -> tuple[str | None, str | None]:
    """The device ``--device spec`` means with ``gpus`` GPUs visible, and None; or None and why it is
    not there. ``spec``: auto, cpu, cuda or cuda:N (already checked by the parser)."""
    if spec == "auto":
        return ("cuda:0" if gpus else "cpu"), None
    if spec == "cpu":
        return "cpu", None
    index = int(spec.partition(":")[2] or 0)
    if not gpus:
        return None, f"--device {spec}: torch sees no GPU here (a CPU build of torch, or no driver); use --device cpu"
    if index >= gpus:
        return None, f"--device {spec}: torch sees {gpus} GPU(s); use cuda:N with N < {gpus}"
    return f"cuda:{index}", None


def verdicts(facts: Facts, device: str = "auto", transfers: tuple[str, ...] = TRANSFERS) -> tuple[Verdict, ...]:
    """One verdict per role of ``ROLES``, for ``--device device`` and the backends ``transfers``."""
    resolved, device_problem = resolve_device(device, len(facts.torch.gpus))
    common = _common_problems(facts) + ((device_problem,) if device_problem else ())
    on_gpu = resolved is not None and resolved.startswith("cuda")
    redis = _redis_problem(facts)
    encoder = common + ((redis,) if redis else ())
    prefill = common + ((f"{redis} (in EPD mode the prefill reads the embeddings there)",) if redis else ())
    encoder_notes = ("Redis not checked: give --redis-url (stage up starts one of its own)",) \
        if facts.redis.url is None else ()
    working, failed = _transfers(facts, transfers, on_gpu)
    transfer_problems = () if working else failed
    transfer_notes = failed if working else ()
    return (
        Verdict("encoder", not encoder, encoder, encoder_notes),
        _transfer_role("prefill", prefill, working, transfer_problems, transfer_notes),
        _transfer_role("decode", common, working, transfer_problems, transfer_notes),
    )


def _transfer_role(role: str, problems: tuple[str, ...], working: tuple[str, ...], transfer_problems: tuple[str, ...],
                   notes: tuple[str, ...]) -> Verdict:
    problems = problems + transfer_problems
    return Verdict(role, not problems, problems, notes, working)


def _common_problems(facts: Facts) -> tuple[str, ...]:
    problems = []
    if facts.torch.version is None:
        problems.append(f"torch does not import ({facts.torch.error}): {SETUP}")
    elif facts.torch.build_error:
        problems.append(facts.torch.build_error)
    if facts.transformers is None:
        problems.append(f"transformers is not installed: {SETUP}")
    return tuple(problems)


def _redis_problem(facts: Facts) -> str | None:
    redis = facts.redis
    if redis.url is None or redis.reachable:
        return None
    return f"Redis at {redis.url} does not answer: start it, or fix --redis-url"


def _transfers(facts: Facts, transfers: tuple[str, ...], on_gpu: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The backends of ``transfers`` that work here, and one line per backend that does not."""
    working, failed = [], []
    for name in transfers:
        problem = _backend_problem(facts.backend(name), facts.torch.build, on_gpu)
        if problem is None:
            working.append(name)
        else:
            failed.append(problem)
    return tuple(working), tuple(failed)


def _backend_problem(backend: Backend, torch_build: str | None, on_gpu: bool) -> str | None:
    """Why ``backend`` cannot move KV here (naming the fix), or None."""
    others = [name for name in TRANSFERS if name != backend.name]
    instead = f" or use --transfer {others[0]}" if others else ""
    wanted = _wanted_dist(backend.name, torch_build)
    if not backend.dists:
        return f"{backend.name}: not installed: {SETUP}" + (f" (it installs {wanted})" if wanted else "") + instead
    if backend.name == "mooncake" and len(backend.dists) > 1:
        return (f"mooncake: {' and '.join(backend.dists)} are installed and overwrite each other's files: "
                f"pip uninstall them, then {SETUP}")
    if not backend.importable:
        fix = ("apt-get install libibverbs1 librdmacm1 (scripts/setup.sh does)"
               if "libibverbs" in (backend.import_error or "") or "librdmacm" in (backend.import_error or "")
               else SETUP)
        return f"{backend.name}: does not import ({backend.import_error}): {fix}{instead}"
    if on_gpu and not backend.gpu_capable:
        if backend.name == "mooncake":
            names = ", ".join(dist.split(" ")[0] for dist in backend.dists)
            fit = f" (it installs {wanted})" if wanted else ""
            return f"mooncake: {names} cannot register GPU memory: {SETUP}{fit}{instead}"
        need = f"{wanted} is not installed" if wanted else f"no NIXL build fits torch {torch_build}"
        return f"{backend.name}: cannot register GPU memory ({need}): {SETUP}{instead}"
    return None


def _wanted_dist(name: str, torch_build: str | None) -> str | None:
    """The distribution ``scripts/setup.sh`` installs for backend ``name`` beside a torch of ``torch_build``."""
    if torch_build is None:
        return None
    return (MOONCAKE_BUILDS if name == "mooncake" else NIXL_BUILDS).get(torch_build)
