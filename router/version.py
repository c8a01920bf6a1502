"""The installed release of epd-stage, as the router reports it (``/server_info``, ``/openapi.json``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("epd-stage")
except PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0+unknown"
