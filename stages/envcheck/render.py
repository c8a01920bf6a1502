"""``stage env``'s output from the facts and the verdicts (pure: strings and dicts, no I/O).

    text(facts, device, verdicts) -> str    one screen: a line per fact, a line per role plus its problems
    as_json(facts, device, verdicts) -> dict   every fact and verdict, for bug reports (json.dumps-able)

The JSON's keys: ``stage`` (this project's version), ``python``, ``platform``, ``torch`` (with ``gpus`` and ``driver``), ``transformers``,
``backends``, ``ucx``, ``rdma``, ``redis``, ``device`` (asked and resolved) and ``verdicts`` (per role).
"""

from __future__ import annotations

from dataclasses import asdict

from stages.envcheck.facts import Backend, Facts, TorchFacts, UcxFacts
from stages.envcheck.verdict import Verdict, resolve_device

GIB = 1 << 30
WIDTH = 13  # the label column


def text(facts: Facts, device: str, verdicts: tuple[Verdict, ...]) -> str:
    resolved, _ = resolve_device(device, len(facts.torch.gpus))
    rows = [
        ("epd-stage", f"{facts.stage or 'not installed'}  python {facts.python}  {facts.platform}"),
        ("torch", _torch(facts.torch)),
        ("transformers", facts.transformers or "not installed"),
        *_gpus(facts.torch),
        *((backend.name, _backend(backend)) for backend in facts.backends),
        ("UCX", _ucx(facts.ucx)),
        ("RDMA", _rdma(facts.rdma)),
        ("Redis", _redis(facts)),
        ("device", f"{device} -> {resolved or 'not here'}"),
    ]
    lines = [f"{label:<{WIDTH}}{value}" for label, value in rows]
    for verdict in verdicts:
        via = f" (via {', '.join(verdict.transfers)})" if verdict.transfers else ""
        lines.append(f"{verdict.role:<{WIDTH}}{'ok' + via if verdict.ok else 'NOT OK'}")
        lines += [f"{'':<{WIDTH}}- {problem}" for problem in verdict.problems]
        lines += [f"{'':<{WIDTH}}  note: {note}" for note in verdict.notes]
    return "\n".join(lines)


def as_json(facts: Facts, device: str, verdicts: tuple[Verdict, ...]) -> dict:
    resolved, problem = resolve_device(device, len(facts.torch.gpus))
    return {**asdict(facts), "device": {"asked": device, "resolved": resolved, "problem": problem},
            "verdicts": {verdict.role: asdict(verdict) for verdict in verdicts}}


def _torch(torch: TorchFacts) -> str:
    if torch.version is None:
        return f"does not import: {torch.error}"
    cuda = f"CUDA {torch.cuda}" if torch.cuda else "CPU build"
    build = f", transfer builds: {torch.build}" if torch.build else f" ({torch.build_error})"
    return f"{torch.version} ({cuda}{build})"


def _gpus(torch: TorchFacts) -> list[tuple[str, str]]:
    driver = ("driver", torch.driver or "none found (no nvidia-smi, no /proc/driver/nvidia/version)")
    if not torch.gpus:
        why = torch.cuda_reason or ("a CPU build of torch" if torch.version and not torch.cuda else "no GPU")
        return [driver, ("GPUs", f"none visible ({why})")]
    rows = [driver]
    for gpu in torch.gpus:
        memory = (f"{gpu.free_bytes / GIB:.1f} of {gpu.total_bytes / GIB:.1f} GiB free"
                  if gpu.free_bytes is not None and gpu.total_bytes is not None else f"memory unknown: {gpu.error}")
        rows.append((f"GPU {gpu.index}", f"{gpu.name}, {memory}"))
    return rows


def _backend(backend: Backend) -> str:
    if not backend.dists:
        return "not installed"
    imports = "imports" if backend.importable else f"does not import: {backend.import_error}"
    gpu = "can register GPU memory" if backend.gpu_capable else "host memory only"
    return f"{', '.join(backend.dists)}: {imports}; {gpu}"


def _ucx(ucx: UcxFacts) -> str:
    env = f"; {' '.join(ucx.env)}" if ucx.env else ""
    if ucx.transports is None:
        return f"transports unknown: {ucx.unknown_why}{env}"
    listed = " ".join(ucx.transports) or "none"
    return f"{listed} ({ucx.source}){env}"


def _rdma(devices: tuple[str, ...] | None) -> str:
    if devices is None:
        return "unknown (/sys/class/infiniband is unreadable)"
    return " ".join(devices) if devices else "none (/sys/class/infiniband lists no device)"


def _redis(facts: Facts) -> str:
    redis = facts.redis
    if redis.url is None:
        return "not checked (no --redis-url, no EPD_REDIS_URL)"
    return f"{redis.url}: " + ("answers PING" if redis.reachable else f"does not answer ({redis.error})")
