"""EPD mode: who gets what for one request, with the embedding cache in the loop.

``EPDPlanner.plan`` (awaited by the dispatcher once per attempt):
1. P and D as in pd mode (``PDPlanner``: one fresh room), their body with every image part replaced
   by its reference (``router.plan.image_refs``), every video part by its ``video_ref``
   (``router.plan.videos``: a video's key joins the images' in every step below; the encoder gets it
   as an image with ``video``, its resolved sampling). No eligible pair: 503 before any Redis call.
2. The cache index says which of the request's keys are cached, and each missing key gets an
   encoder by ``--policy-encoder`` (``cache_aware``: the same key, the same encoder) among the
   eligible encoders with the router's vision fingerprint, or every one the request's own prefill
   when ``router.plan.local_encode`` says it encodes them (``--local-encode``: ``Plan.local_encode``;
   its encode call is an encoder side call to the prefill's URL), and is claimed on that encoder's behalf
   (``claim(key, owner=encoder_id, --claim-lease-s)``; the encoder renews it once the image is queued
   there). A key whose claim is held already is being encoded elsewhere: it is not sent, the prefill
   waits for it; unless it is held for an encoder this attempt will not send to (one that failed
   this request, or out of rotation: ``_gone``), which may never end it: then it is taken over for
   the encoder picked now (``contract.claims``). A missing key with no eligible encoder (and no
   prefill that encodes): 503.
3. Redis round trips, however many images: one with ``cache_aware`` (an encoder per key is known
   before the lookup: ``lookup_claim`` looks up and claims in one call), two with ``round_robin`` and
   ``least_load``, which pick for the missing keys only (``contains_many``, then ``claim_many``).
4. One encoder side call per encoder with keys: ``POST /v1/encode {"room", "images"}``, sent at the
   same moment as the prefill's and the decode's calls.

Redis down at the router (``CacheUnavailable``): every image is sent to its encoder unclaimed (the
encoder claims it itself); the encoder and the prefill then answer 503 naming Redis if they cannot
reach it either, so the client gets that answer, never a hang.

Abort (``Plan.on_abort``, run by the dispatcher when an attempt ends without success): the claims
the attempt took that their encoder has not taken up are released (only those: a claim taken up is
its encoder's to end, one taken anew for another request after this one lapsed is that request's),
so a retry's encoder can claim the keys at once instead of waiting for the lease, and the requests
waiting on those keys elsewhere hear that the encode was abandoned (``EmbeddingCache.abandon``: their
prefill answers 503 ``encode_abandoned``, retried); each encoder of the plan that may have the request
gets ``POST /v1/abort {"room"}`` (its queued work for the room is dropped and ended as abandoned;
closing the connection does not), within ``--health-timeout-s``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Collection, Sequence

import aiohttp
import msgspec

from cache.errors import CacheUnavailable
from cache.store import EmbeddingCache, Lookup
from contract.encode import AbortRequest
from contract.paths import ABORT_PATH, ENCODE_PATH
from router.config import RouterConfig
from router.errors import no_worker
from router.plan.image_refs import encode_body, with_refs
from router.plan.local_encode import encode_locally
from router.plan.modes import Call, PDPlanner, Plan, Target
from router.upstream.client import JSON_HEADERS, Upstream
from router.fleet.workers import Pool, Worker

log = logging.getLogger(__name__)
ENCODING_ROLES = ("encoder", "prefill")  # a prefill encodes its own requests' images (router.plan.local_encode)


class EPDPlanner:
    """``fingerprint`` (the encoders' vision fingerprint) is set by ``Router.start`` after discovery,
    before the first request; only encoders with that fingerprint are chosen."""

    def __init__(self, encoders: Pool, pd: PDPlanner, cache: EmbeddingCache, upstream: Upstream,
                 config: RouterConfig) -> None:
        self.encoders = encoders
        self.pd = pd
        self.cache = cache
        self.upstream = upstream
        self.config = config
        self.fingerprint: str | None = None

    async def aclose(self) -> None:
        """Close the embedding cache's connections (``Router.close``, once, at shutdown)."""
        await self.cache.aclose()

    async def plan(self, call: Call, exclude: Collection[str]) -> Plan:
        media = [item for item in call.media if item.key is not None]
        refs = dataclasses.replace(call, body=with_refs(call.body, call.images, call.videos), raw=None) \
            if media else call
        pd = await self.pd.plan(refs, exclude)
        keys = list(dict.fromkeys(item.key for item in media if item.key is not None))
        if not keys:
            return pd
        room, prefill = pd.room, pd.partner
        assert room is not None and prefill is not None
        takeover = self._gone(exclude)
        candidates = self._candidates(call.model, exclude)
        config = self.config
        local = encode_locally(config.local_encode, prefill.worker, candidates, self.fingerprint,
                               config.local_encode_queue)
        pick = (lambda _key: prefill.worker) if local else (lambda key: self.encoders.pick(candidates, key))
        if local or (config.policy_encoder == "cache_aware" and candidates):
            cached, sent = await self._look_up_and_claim([(key, pick(key)) for key in keys], str(room), takeover)
        else:
            cached, claims = await self._cached(keys)
            sent = await self._assign([k for k in keys if k not in cached], candidates, call.model, str(room),
                                      takeover if claims else None)
        by_key = {item.key: item for item in media}
        targets = tuple(Target("encoder", worker, encode_body(room, [by_key[k] for k in mine]), ENCODE_PATH)
                        for worker, mine in sent)
        images = {key: "" for key in keys} | {key: worker.url for worker, mine in sent for key in mine}
        return dataclasses.replace(pd, sides=(*targets, *pd.sides), images=images, cached=frozenset(cached),
                                   local_encode=local and bool(sent),
                                   on_abort=lambda unreachable: self._abort(room, sent, unreachable))

    async def _cached(self, keys: Sequence[str]) -> tuple[set[str], bool]:
        """The cached keys, and whether claims can be taken (False: Redis is down; send everything)."""
        try:
            return await self.cache.contains_many(keys), True
        except CacheUnavailable as exc:
            log.warning("epd: sending every image to an encoder unclaimed: %s", exc)
            return set(), False

    def _candidates(self, model: str | None, exclude: Collection[str]) -> list[Worker]:
        """The eligible encoders with the router's vision fingerprint."""
        return [w for w in self.encoders.candidates(model, exclude) if w.vision_fingerprint == self.fingerprint]

    def _gone(self, exclude: Collection[str]) -> list[str]:
        """The ids of the encoders (and prefills that encode) this attempt will not send to (failed this
        request, or out of rotation): a claim held for one of them is taken over (``contract.claims``),
        as it may never end."""
        return [w.encoder_id for w in self.encoders.members  # every worker, once: the registry's one list
                if w.encoder_id is not None and w.role in ENCODING_ROLES and (w.url in exclude or not w.eligible())]

    async def _look_up_and_claim(self, chosen: Sequence[tuple[str, Worker]], tag: str,
                                 takeover: Sequence[str]) -> tuple[set[str], list[tuple[Worker, list[str]]]]:
        """Each key's encoder known before the lookup (``cache_aware``: a function of the key; local
        encoding: the prefill), so the lookup and the claims are one Redis call
        (``EmbeddingCache.lookup_claim``). The cached keys and the encoders that get images
        (``_assign``'s answer). Redis down: nothing cached, every image sent unclaimed."""
        assert all(worker.encoder_id is not None for _, worker in chosen)
        try:
            found = await self.cache.lookup_claim([(key, worker.encoder_id or "") for key, worker in chosen],
                                                  self.config.claim_lease_s, tag, takeover)
        except CacheUnavailable as exc:
            log.warning("epd: sending every image to an encoder unclaimed: %s", exc)
            found = [Lookup.CLAIMED] * len(chosen)
        cached = {key for (key, _), got in zip(chosen, found) if got is Lookup.CACHED}
        return cached, _by_encoder([pair for pair, got in zip(chosen, found) if got is Lookup.CLAIMED])

    async def _assign(self, missing: list[str], candidates: list[Worker], model: str | None, tag: str,
                      takeover: Sequence[str] | None) -> list[tuple[Worker, list[str]]]:
        """round_robin, least_load: the encoders that get images, each with its keys, picked among
        ``candidates`` for the missing keys only (a cached key takes no turn); keys claimed elsewhere
        are dropped (they are pending there). ``takeover`` None: Redis is down, nothing is claimed."""
        if not missing:
            return []
        if not candidates:
            raise no_worker("encoder", model)
        chosen = [(key, self.encoders.pick(candidates, key)) for key in missing]
        won = await self._claim(chosen, tag, takeover) if takeover is not None else [True] * len(chosen)
        return _by_encoder([pair for pair, mine in zip(chosen, won) if mine])

    async def _claim(self, chosen: Sequence[tuple[str, Worker]], tag: str, takeover: Sequence[str]) -> list[bool]:
        """Each key claimed for its encoder, all in one Redis call (``EmbeddingCache.claim_many``)."""
        assert all(worker.encoder_id is not None for _, worker in chosen)
        try:
            return await self.cache.claim_many([(key, worker.encoder_id or "") for key, worker in chosen],
                                               self.config.claim_lease_s, tag, takeover)
        except CacheUnavailable as exc:  # Redis went away since contains_many: the encoders claim them themselves
            log.warning("epd: sending %d image(s) unclaimed: %s", len(chosen), exc)
            return [True] * len(chosen)

    async def _abort(self, room: int, sent: Sequence[tuple[Worker, list[str]]], unreachable: frozenset[str]) -> None:
        """Every claim this attempt took that its encoder has not taken up is abandoned; each encoder
        that may have the request is told to drop the room's work (the claims it took up end so)."""
        await asyncio.gather(*(self._release(room, worker, keys) for worker, keys in sent),
                             *(self._post_abort(room, worker) for worker, _ in sent if worker.url not in unreachable))

    async def _post_abort(self, room: int, worker: Worker) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with self.upstream.session.post(worker.url + ABORT_PATH, data=msgspec.json.encode(AbortRequest(room)),
                                                  headers=JSON_HEADERS, timeout=timeout) as response:
                await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("epd: could not abort room %d at encoder %s: %s", room, worker.url, exc)

    async def _release(self, room: int, worker: Worker, keys: Sequence[str]) -> None:
        """The claims taken in ``room`` for ``worker`` that it has not taken up, released in one Redis
        call; the requests waiting on those keys hear the encode was abandoned (a retry claims it anew)."""
        assert worker.encoder_id is not None
        reason = f"the request that claimed it for encoder {worker.url} ended before that encoder took it up"
        try:
            await self.cache.abandon(keys, worker.encoder_id, reason, str(room))
        except CacheUnavailable as exc:
            log.info("epd: could not release the claims of %s (they lapse by themselves): %s", worker.url, exc)


def _by_encoder(chosen: Sequence[tuple[str, Worker]]) -> list[tuple[Worker, list[str]]]:
    """(key, encoder) pairs grouped by encoder, in first-seen order."""
    sent: dict[str, tuple[Worker, list[str]]] = {}
    for key, worker in chosen:
        sent.setdefault(worker.url, (worker, []))[1].append(key)
    return list(sent.values())
