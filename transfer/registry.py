"""Transfer backends by name, imported on first use (so a process only loads the library it runs)."""

from __future__ import annotations

import importlib

from transfer.base import TransferBackend, TransferConfig

BACKENDS = ("mooncake", "nixl")
_CLASSES = {
    "mooncake": ("transfer.mooncake", "MooncakeBackend"),
    "nixl": ("transfer.nixl", "NixlBackend"),
}


def backend_class(name: str) -> type[TransferBackend]:
    """The class registered as ``name``; ValueError for an unknown name, ImportError (naming the fix:
    scripts/setup.sh installs the build that matches torch, ``stage env`` says what failed) when its
    library is missing or does not load."""
    if name not in _CLASSES:
        raise ValueError(f"--transfer must be one of {BACKENDS}, got {name!r}")
    module, cls = _CLASSES[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise ImportError(f"the {name} transfer backend's library does not load ({exc}); rerun scripts/setup.sh "
                          "(it installs the build that matches torch), or see what `stage env` says") from exc


def create_backend(name: str, config: TransferConfig) -> TransferBackend:
    """A started backend of kind ``name``; the caller registers its KV pool and releases it at exit."""
    return backend_class(name)(config)
