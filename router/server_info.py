"""The router's ``/server_info``: what it is (role ``router``, mode, version, this process's start id),
its workers per role, and the limits it enforces on a chat request: its own flags, tightened by the
limits its stages publish (``router.plan.limits``). Pure: reads the router's state, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.version import VERSION

if TYPE_CHECKING:
    from router.runtime import Router


def server_info(router: Router) -> dict:
    config, stage = router.config, router.stage_limits()
    workers = {role: {"total": len(pool.workers), "known": sum(w.known for w in pool.workers),
                      "healthy": sum(w.known and w.healthy for w in pool.workers)}
               for role, pool in router.registry.pools.items()}
    return {
        "role": "router", "mode": config.mode, "version": VERSION, "instance_id": config.instance_id,
        "workers": workers, "models": [card["id"] for card in router.models()], "in_flight": router.in_flight,
        "limits": {"max_body_bytes": router.body_cap(stage)[0], "max_images_per_request": router.max_images(stage),
                   "max_in_flight": config.max_in_flight, "max_image_bytes": config.max_image_bytes,
                   "max_videos_per_request": router.max_videos(stage), "max_video_bytes": config.max_video_bytes},
        "stage_limits": stage.to_json(),
        "chat_schema_from": router.chat_schema["source"] if router.chat_schema is not None else None,
    }
