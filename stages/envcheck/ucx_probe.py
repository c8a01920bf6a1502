"""The UCX transports NIXL can use here, as ``ucx_info -d`` lists them, without that tool (the NIXL
wheels bundle UCX's libraries, not its binaries) and without a network call.

    ucx_transports(libs) -> (transports, None) | (None, why)

``libs`` is a wheel's ``nixl_cu*.libs`` folder; its ``libuct-*.so`` is asked through ctypes, in a
child process (``python -m stages.envcheck.ucx_probe LIBS``): every UCT component (its modules are
the ``ucx/libuct_*.so`` beside it), every memory domain of each, every transport of each domain,
printed as ``tl/device`` lines. Opening a memory domain reads local devices only. The child ends with
``os._exit``: UCX's library destructors crash an interpreter that exits normally after this.

The structs are UCX's public ``uct.h`` ones, unchanged since UCX 1.9 (``uct_component_attr_t``,
``uct_md_resource_desc_t``, ``uct_tl_resource_desc_t``).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 20.0
_NAME, _MD_COUNT, _MD_RESOURCES = 1, 2, 4  # UCT_COMPONENT_ATTR_FIELD_*


class _MdResource(ctypes.Structure):
    _fields_ = [("md_name", ctypes.c_char * 16)]  # UCT_MD_NAME_MAX


class _ComponentAttr(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("name", ctypes.c_char * 16), ("md_resource_count", ctypes.c_uint),
                ("md_resources", ctypes.POINTER(_MdResource)), ("flags", ctypes.c_uint64)]


class _TlResource(ctypes.Structure):
    _fields_ = [("tl_name", ctypes.c_char * 10), ("dev_name", ctypes.c_char * 32), ("dev_type", ctypes.c_int),
                ("sys_device", ctypes.c_uint8)]


def ucx_transports(libs: Path, timeout_s: float = TIMEOUT_S) -> tuple[tuple[str, ...] | None, str | None]:
    """``("tl/device", ...)`` of the UCX in ``libs``, and None; or None and why they are unknown."""
    env = {**os.environ, "UCX_LOG_LEVEL": "fatal"}
    try:
        out = subprocess.run([sys.executable, "-m", "stages.envcheck.ucx_probe", str(libs)], capture_output=True,
                             text=True, timeout=timeout_s, env=env, cwd=Path(__file__).resolve().parents[2])
    except subprocess.TimeoutExpired:
        return None, f"UCX's query of {libs.name} took over {timeout_s:g} s"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        return None, f"UCX's query of {libs.name} failed: {last}"
    return tuple(line for line in out.stdout.splitlines() if line), None


def _query(libs: Path) -> list[str]:
    """The child's work: the ``tl/device`` pairs, in UCX's order."""
    for prefix in ("libucs-", "libuct-"):  # uct needs ucs's symbols loaded first
        library = next(libs.glob(f"{prefix}*.so*"), None)
        if library is None:
            raise FileNotFoundError(f"no {prefix}*.so in {libs}")
        uct = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    components, count = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_uint()
    _check(uct.uct_query_components(ctypes.byref(components), ctypes.byref(count)), "uct_query_components")
    found = []
    try:
        for i in range(count.value):
            component = ctypes.c_void_p(components[i])
            attr = _ComponentAttr(field_mask=_NAME | _MD_COUNT)
            _check(uct.uct_component_query(component, ctypes.byref(attr)), "uct_component_query")
            domains = (_MdResource * max(1, attr.md_resource_count))()
            attr.md_resources, attr.field_mask = ctypes.cast(domains, ctypes.POINTER(_MdResource)), _MD_RESOURCES
            _check(uct.uct_component_query(component, ctypes.byref(attr)), "uct_component_query")
            for domain in domains[:attr.md_resource_count]:
                found += _domain_transports(uct, component, domain.md_name)
    finally:
        uct.uct_release_component_list(components)
    return found


def _domain_transports(uct: ctypes.CDLL, component: ctypes.c_void_p, md_name: bytes) -> list[str]:
    config, md = ctypes.c_void_p(), ctypes.c_void_p()
    if uct.uct_md_config_read(component, None, None, ctypes.byref(config)) != 0:
        return []
    status = uct.uct_md_open(component, md_name, config, ctypes.byref(md))
    uct.uct_config_release(config)
    if status != 0:
        return []  # a domain whose hardware is absent (UCX itself skips it too)
    resources, count = ctypes.POINTER(_TlResource)(), ctypes.c_uint()
    try:
        if uct.uct_md_query_tl_resources(md, ctypes.byref(resources), ctypes.byref(count)) != 0:
            return []
        pairs = [f"{resources[j].tl_name.decode()}/{resources[j].dev_name.decode()}" for j in range(count.value)]
        uct.uct_release_tl_resource_list(resources)
        return pairs
    finally:
        uct.uct_md_close(md)


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} returned UCS status {status}")


if __name__ == "__main__":
    try:
        lines = _query(Path(sys.argv[1]))
    except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    print("\n".join(lines), flush=True)
    os._exit(0)
