"""``/debug/faults``: arm the server's fault points (``stages.faults``). Mounted only when the
server runs with ``--debug-faults``; without it these paths are 404 like any unknown path."""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from stages.api.errors import bad_request
from stages.faults import POINTS, Fault, Faults


class FaultBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    point: str
    times: int = Field(1, ge=1, le=1_000_000)
    delay_s: float = Field(0.0, ge=0.0, le=600.0)


def add_fault_routes(app: FastAPI, faults: Faults) -> None:
    @app.get("/debug/faults", include_in_schema=False)
    async def list_faults() -> dict:
        return {"points": POINTS, "armed": faults.armed()}

    @app.post("/debug/faults", include_in_schema=False)
    async def arm_fault(body: FaultBody) -> dict:
        try:
            faults.arm(Fault(body.point, body.times, body.delay_s))
        except ValueError as exc:
            raise bad_request(str(exc), "point", "unknown_fault_point") from None
        return {"armed": faults.armed()}
