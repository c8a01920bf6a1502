"""One room's life across the stages (``GET /admin/rooms/{room}``): the router's record merged with
what each stage that served the room reports at ``GET /rooms/{room}`` (each stage keeps its own
bounded ring of rooms; ``docs/admin.md`` lists the events of each role).

A stage that no longer has the room (its ring moved on, or it restarted) or does not answer is
shown with an ``error`` instead of events; the rest of the timeline is still given.
"""

from __future__ import annotations

import asyncio

import aiohttp

from router.dispatch.timeline import RoomRecord
from router.plan.modes import LOCAL_ENCODE


async def stage_events(session: aiohttp.ClientSession, url: str, room: int, timeout_s: float,
                       encoder: bool = False) -> dict:
    """``{"events": [...]}`` from one stage, or ``{"error": why}``. ``encoder``: the worker's encode
    events (``?stage=encoder``: a switchable worker keeps them apart from its role's; an encoder has
    only those)."""
    query = "?stage=encoder" if encoder else ""
    try:
        async with session.get(f"{url}/rooms/{room}{query}",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            body = await response.json(content_type=None)
            if response.status != 200 or not isinstance(body, dict) or not isinstance(body.get("events"), list):
                error = body.get("error") if isinstance(body, dict) else None
                message = error.get("message") if isinstance(error, dict) else None
                return {"error": message or f"GET /rooms/{room} answered HTTP {response.status}"}
            return {"events": body["events"]}
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}".rstrip(": ")}


async def room_view(session: aiohttp.ClientSession, record: RoomRecord, timeout_s: float) -> dict:
    """The record, each stage's events, and every event of all of them in time order (``timeline``)."""
    stages = list(record.workers.items())
    answers = await asyncio.gather(*(stage_events(session, who["url"], record.room, timeout_s, _encodes(stage))
                                     for stage, who in stages))
    view = record.to_json()
    view["stages"] = {stage: {**who, **answer} for (stage, who), answer in zip(stages, answers)}
    timeline = [{"stage": "router", **event} for event in record.events()]
    for stage, answer in view["stages"].items():
        timeline += [{"stage": stage, **event} for event in answer.get("events", ())]
    view["timeline"] = sorted(timeline, key=lambda event: event["t"])
    return view


def _encodes(stage: str) -> bool:
    """A stage label of an encode call: ``encoder``, ``encoder2``, ... or ``local_encode``."""
    return stage.startswith("encoder") or stage == LOCAL_ENCODE
