"""What a stage server plugs into its seams: ``Seams`` plugs in nothing; ``FaultSeams`` (``--debug-faults``)
plugs in the fault points, all sharing one ``Faults`` table that ``/debug/faults`` arms."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from stages.api.lifetime import Generate
from stages.disagg.hooks import DecodeHooks, PrefillHooks
from stages.encoder.worker import EncoderHooks
from stages.faults.encoder import FaultyEncoder
from stages.faults.engine import engine_hook
from stages.faults.http import CrashMiddleware, add_fault_routes, slowed
from stages.faults.points import Faults
from stages.faults.rooms import FaultyDecode, FaultyPrefill
from stages.faults.transfer import FaultyBackend
from transfer.base import TransferBackend


class Seams:
    """Each method says what goes into one seam; asked while the server is built (the room hooks: for
    each coordinator made, a switchable worker's at each role switch)."""

    def before_step(self) -> Callable[[bool], None] | None:
        """The ``AsyncEngine``'s ``before_step`` hook."""
        return None

    def prefill(self) -> PrefillHooks:
        return PrefillHooks()

    def decode(self) -> DecodeHooks:
        return DecodeHooks()

    def encoder(self) -> EncoderHooks:
        return EncoderHooks()

    def backend(self, backend: TransferBackend) -> TransferBackend:
        """The transfer backend the server uses, given the registry's (before it registers its pool)."""
        return backend

    def generate(self, generate: Generate) -> Generate:
        """How the HTTP layer runs a request (``create_app``'s ``generate``), given the server's own."""
        return generate

    def install(self, app: FastAPI) -> None:
        """Add what the app serves beside its own routes (after ``create_app``, before it starts)."""


class FaultSeams(Seams):
    """Every seam gets its fault points; all share ``faults``, the table ``/debug/faults`` arms."""

    def __init__(self) -> None:
        self.faults = Faults()

    def before_step(self) -> Callable[[bool], None] | None:
        return engine_hook(self.faults)

    def prefill(self) -> PrefillHooks:
        return FaultyPrefill(self.faults)

    def decode(self) -> DecodeHooks:
        return FaultyDecode(self.faults)

    def encoder(self) -> EncoderHooks:
        return FaultyEncoder(self.faults)

    def backend(self, backend: TransferBackend) -> TransferBackend:
        return FaultyBackend(backend, self.faults)

    def generate(self, generate: Generate) -> Generate:
        return slowed(generate, self.faults)

    def install(self, app: FastAPI) -> None:
        app.add_middleware(CrashMiddleware, faults=self.faults)
        add_fault_routes(app, self.faults)


def seams_for(debug_faults: bool) -> Seams:
    """The server's seams: the fault points with ``--debug-faults`` (``ServerConfig.debug_faults``), else none."""
    return FaultSeams() if debug_faults else Seams()
