"""The workers the router knows, per role, and how one is picked. Pure: no I/O.

A ``Worker`` is one stage server. What the router learns from it (models, fingerprint, bootstrap
address; an encoder's id and vision fingerprint) is written by discovery (``router.fleet.discovery``)
from its ``/v1/models`` and ``/server_info``; ``healthy`` is written by the health loop and by a dispatcher that could not reach
it; ``outstanding`` and the breaker by the dispatcher through ``lease``/``Lease``; ``id``,
``group``, ``draining`` and ``role`` (of a switchable worker) by the registry (``router.fleet.registry``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.fleet.breaker import CircuitBreaker
from router.plan.policy import Policy, RouteContext

if TYPE_CHECKING:
    from router.plan.videos import PublishedVideo


@dataclass
class Worker:
    url: str
    role: str
    breaker: CircuitBreaker
    healthy: bool = False  # until its first /health answers 200
    late_checks: int = 0  # consecutive health checks that timed out (--health-timeouts)
    outstanding: int = 0  # requests sent to it and not yet finished
    models: tuple[str, ...] = ()  # ids from its /v1/models
    cards: tuple[dict, ...] = ()  # its /v1/models entries, served by the router's /v1/models
    fingerprint: dict | None = None  # prefill and decode: /server_info "fingerprint"
    bootstrap: tuple[str, int] | None = None  # prefill: where decodes dial it
    # encoder: /server_info "encoder_id", the owner of the claims taken for it; an EPD switchable worker serving as
    # prefill publishes it too (it can encode its own images: local encoding); None for any other prefill or decode
    encoder_id: str | None = None
    vision_fingerprint: str | None = None  # /server_info "vision_fingerprint", the key of image keys (as encoder_id)
    limits: dict[str, int] | None = None  # /server_info "limits" the router enforces (router.plan.limits.published)
    # /server_info "video" (router.plan.videos.video_published): None unknown (not published), False null
    takes_video: bool | None = None
    video: PublishedVideo | None = None
    known: bool = False  # discovery has read its info at least once
    id: str = ""  # the admin API's name for it (w1, w2, ...), stable across role switches
    group: str | None = None  # pairing label: given when added, else its stage's --group
    switchable: bool = False  # a `stage serve pd` worker: the router may switch it between the roles it can take
    roles: tuple[str, ...] = ()  # /server_info "roles" of a switchable worker, the roles it can take; () if fixed
    draining: bool = False  # gets no new request (admin drain, or a role switch under way)

    @property
    def name(self) -> str:
        return self.url

    def eligible(self) -> bool:
        return self.known and self.healthy and not self.draining and self.breaker.allows()

    def serves(self, model: str | None) -> bool:
        return model is None or model in self.models

    def lease(self) -> Lease | None:
        """Count one request against this worker until the lease ends (see ``Lease``); None, and
        nothing counted, if its breaker refuses a request now."""
        if not self.breaker.begin():
            return None
        self.outstanding += 1
        return Lease(self)


class Lease:
    """One request's hold on a worker. Ended exactly once: ``success()``, ``failure()`` or
    ``cancel()`` (no verdict); ending it again does nothing, so ``cancel()`` in a ``finally``
    after a verdict is safe."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._open = True

    def success(self) -> None:
        self._end(self.worker.breaker.success)

    def failure(self) -> None:
        self._end(self.worker.breaker.failure)

    def cancel(self) -> None:
        self._end(self.worker.breaker.cancel)

    def _end(self, verdict: Callable[[], object]) -> None:
        if self._open:
            self._open = False
            self.worker.outstanding -= 1
            verdict()


def lease_all(workers: Sequence[Worker]) -> list[Lease] | None:
    """A lease on each of ``workers`` (a plan's targets), all in one step: nothing awaits between
    the breakers' answers and the leases. None, and nothing held, if any breaker refuses now (it
    opened, or a half-open trial was taken, since the plan picked it): the caller plans again
    without the workers that refuse (``not w.breaker.allows()``)."""
    leases: list[Lease] = []
    for worker in workers:
        lease = worker.lease()
        if lease is None:
            for held in leases:
                held.cancel()
            return None
        leases.append(lease)
    return leases


@dataclass
class Pool:
    """The workers of one role and the policy that picks among them. ``members`` is the list the
    workers are kept in (the router's registry, ``router.fleet.registry``, shares one among its pools);
    ``workers`` are those of ``role`` among them, read when asked, so a worker whose role changes
    leaves one pool and joins the other at once."""

    role: str
    members: list[Worker]
    policy: Policy

    @property
    def workers(self) -> list[Worker]:
        return [w for w in self.members if w.role == self.role]

    def candidates(self, model: str | None = None, exclude: Collection[str] = ()) -> list[Worker]:
        return [w for w in self.workers if w.eligible() and w.serves(model) and w.url not in exclude]

    def pick(self, candidates: Sequence[Worker], key: str | None = None, context: RouteContext | None = None) -> Worker:
        return self.policy.choose(candidates, key, context)


def compatible(prefill: Worker, decode: Worker) -> bool:
    """A P's KV is valid in a D's blocks only if their fingerprints are equal."""
    return prefill.fingerprint is not None and prefill.fingerprint == decode.fingerprint


def fingerprint_diff(a: dict | None, b: dict | None) -> list[str]:
    """The fields on which two fingerprints differ, as ``field: a != b`` (all of them if one is missing)."""
    if a is None or b is None:
        return ["fingerprint: unknown"]
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


Pairable = Callable[[Worker, Worker], bool]  # (prefill, decode) -> may they form a pair
PARTNERS = 16  # prefills ``with_partner`` tries first: one per kind of pair (group, fingerprint) found


def pick_pair(prefills: Pool, decodes: Pool, model: str | None, exclude: Collection[str],
              pairable: Pairable = compatible, context: RouteContext | None = None) -> tuple[Worker, Worker] | None:
    """D by its policy among decodes with at least one prefill it is ``pairable`` with, then P by its
    policy (given ``context``, the request) among those prefills; None when no such pair is eligible."""
    ps = prefills.candidates(model, exclude)
    ds = with_partner(decodes.candidates(model, exclude), ps, pairable)
    if not ds:
        return None
    decode = decodes.pick(ds)
    prefill = prefills.pick([p for p in ps if pairable(p, decode)], context=context)
    return prefill, decode


def with_partner(decodes: Sequence[Worker], prefills: Sequence[Worker], pairable: Pairable) -> list[Worker]:
    """The ``decodes`` (in order) that are ``pairable`` with at least one of ``prefills``. A prefill that
    paired an earlier decode is tried first (workers of one group or fingerprint pair alike), so it
    takes O(P + D x groups) calls of ``pairable``, not O(P x D) when the pairing rules split the fleet;
    only a decode no partner found so far pairs with scans the prefills."""
    out: list[Worker] = []
    partners: list[Worker] = []  # one prefill per kind of pair found so far
    for decode in decodes:
        if any(pairable(p, decode) for p in partners):
            out.append(decode)
        elif (found := next((p for p in prefills if pairable(p, decode)), None)) is not None:
            if len(partners) < PARTNERS:
                partners.append(found)
            out.append(decode)
    return out


def has_pair(prefills: Pool, decodes: Pool, model: str | None, exclude: Collection[str],
             pairable: Pairable = compatible) -> bool:
    """Whether ``pick_pair`` would find a pair (asks no policy, so it moves no cursor)."""
    ps = prefills.candidates(model, exclude)
    return any(pairable(p, d) for p in ps for d in decodes.candidates(model, exclude))


def pairing_report(prefills: Pool, decodes: Pool) -> tuple[int, list[str]]:
    """Among the workers discovery knows: how many (prefill, decode) pairs are compatible, and one
    line per incompatible pair naming the fingerprint fields that differ (they are never paired)."""
    pairs, lines = 0, []
    for p in (w for w in prefills.workers if w.known):
        for d in (w for w in decodes.workers if w.known):
            if compatible(p, d):
                pairs += 1
            else:
                lines.append(f"prefill {p.url} and decode {d.url} are never paired: their fingerprints differ "
                             f"({'; '.join(fingerprint_diff(p.fingerprint, d.fingerprint))})")
    return pairs, lines
