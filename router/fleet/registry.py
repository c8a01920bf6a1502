"""The router's workers, in one place: the one list of them (in admission order) and, per role, a
``Pool`` that is a live view of it. Pure: no I/O; called on the event loop.

Contracts:
- Every change of membership is one call here: ``add`` (it names the worker ``w1``, ``w2``, ...),
  ``remove``, ``drain``, ``resume`` and, for a role switch, ``begin_switch`` / ``move`` /
  ``end_switch``. The admin API (``router.fleet.membership``) and DNS discovery (``router.fleet.dns_watch``) call them; the
  health loop, the load sampler and the admin listing iterate the registry; the dispatcher's
  planners pick from its pools. No one else keeps a list of workers.
- A pool's ``workers`` are the registry's workers of its role, read when asked: a worker added,
  removed or moved is in the right views at once, and never in two.
- The router's metrics export exactly the workers in the registry, under their current role;
  ``on_remove`` callbacks (the load history, the pairing state) forget a worker that left, and so does
  the policy of the pool it leaves (removed, or moved to another role: ``Policy.forget``).
- A refused change is a ``RouterError`` (4xx) and changes nothing.
- Each worker's source, where it came from, is kept from ``add`` to ``remove``: ``static`` (a
  ``--prefill``-like flag), ``admin`` (the admin API) or a ``--discover`` source's label
  (``dns://NAME:PORT``, ``dns+srv://NAME``; ``router.fleet.dns_watch`` follows only its own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from router.fleet.breaker import CircuitBreaker
from router.config import MODE_ROLES, RouterConfig
from router.errors import RouterError
from router.metrics import Metrics
from router.plan.policy import Policy, make_policy
from router.fleet.workers import Pool, Worker


class Registry:
    def __init__(self, mode: str, policies: Mapping[str, Policy], metrics: Metrics,
                 breaker: Callable[[], CircuitBreaker]) -> None:
        """``policies``: the picking policy of each role of ``mode`` (``router.config.MODE_ROLES``);
        ``breaker`` makes a new worker's circuit breaker."""
        self.mode = mode
        self._workers: list[Worker] = []  # the one list; the pools read it
        self.pools = {role: Pool(role, self._workers, policies[role]) for role in MODE_ROLES[mode]}
        self.metrics = metrics
        self.on_remove: list[Callable[[Worker], None]] = []
        self._breaker = breaker
        self._ids = 0
        self._moving: set[str] = set()  # ids of the workers switching roles now
        self._sources: dict[str, str] = {}  # worker id -> where it came from (see the module docstring)

    @classmethod
    def for_config(cls, config: RouterConfig, metrics: Metrics) -> Registry:
        """The registry of ``config``'s mode with its workers (``--prefill`` etc.) added, in flag order."""
        roles = MODE_ROLES[config.mode]
        policies = {role: make_policy(config.policy(role), config.prefix_settings, metrics.observe_prefix)
                    for role in roles}
        registry = cls(config.mode, policies, metrics,
                       lambda: CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s))
        for role in roles:
            for url in getattr(config, role):
                registry.add(registry.new_worker(url, role))
        return registry

    # --- reading -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Worker]:
        """Every worker in admission order (a snapshot: changes made while iterating are not seen)."""
        return iter(tuple(self._workers))

    def __len__(self) -> int:
        return len(self._workers)

    def find(self, worker_id: str) -> Worker:
        """The worker named ``worker_id``; RouterError 404 ``worker_not_found`` if none is."""
        worker = next((w for w in self._workers if w.id == worker_id), None)
        if worker is None:
            raise RouterError(404, f"no worker {worker_id!r}; GET /admin/workers lists them", code="worker_not_found")
        return worker

    def by_url(self, url: str) -> Worker | None:
        return next((w for w in self._workers if w.url == url), None)

    def switching(self, worker: Worker) -> bool:
        return worker.id in self._moving

    def source(self, worker: Worker) -> str:
        """Where ``worker`` came from: ``static``, ``admin`` or a ``--discover`` source's label."""
        return self._sources.get(worker.id, "static")

    def of_source(self, source: str) -> list[Worker]:
        """The workers that came from ``source``, in admission order."""
        return [w for w in self._workers if self._sources.get(w.id) == source]

    # --- changing ------------------------------------------------------------------------------
    def new_worker(self, url: str, role: str, group: str | None = None) -> Worker:
        """A worker not yet added (discovery fills it in before ``add``)."""
        return Worker(url, role, self._breaker(), group=group)

    def check_new(self, url: str, role: str) -> None:
        """RouterError unless a worker at ``url`` may join as ``role``: 400 ``invalid_role`` for a role
        this router has no pool for, 409 ``worker_exists`` for a URL it has."""
        if role not in self.pools:
            raise RouterError(400, f"this router runs {self.mode} mode: it takes {', '.join(self.pools)} workers, "
                              f"not {role!r}",
                              code="invalid_role", param="role")
        if (known := self.by_url(url)) is not None:
            raise RouterError(409, f"{url} is already worker {known.id} ({known.role})", code="worker_exists")

    def add(self, worker: Worker, source: str = "static") -> Worker:
        """Admit ``worker`` from ``source`` (``check_new`` first): it gets the next id and is exported in
        the metrics."""
        self.check_new(worker.url, worker.role)
        self._ids += 1
        worker.id = f"w{self._ids}"
        self._sources[worker.id] = source
        self._workers.append(worker)
        self.metrics.watch([worker])
        return worker

    def remove(self, worker: Worker, force: bool = False) -> None:
        """Forget ``worker``: 409 ``worker_busy`` while it switches roles, or while it has requests in
        flight unless ``force`` (those still finish). Then every ``on_remove`` callback is called."""
        self._check_still(worker, "remove")
        if worker.outstanding and not force:
            raise RouterError(409, f"{worker.id} ({worker.role} {worker.url}) has {worker.outstanding} request(s) in "
                              f"flight: drain it first (POST /admin/workers/{worker.id}/drain) or remove it with "
                              "?force=true", code="worker_busy")
        self._workers.remove(worker)
        self._sources.pop(worker.id, None)
        self.metrics.unwatch(worker)
        self.pools[worker.role].policy.forget(worker.name)
        for forget in self.on_remove:
            forget(worker)

    def drain(self, worker: Worker) -> None:
        """``worker`` gets no new request (the requests it holds finish)."""
        worker.draining = True

    def resume(self, worker: Worker) -> None:
        """``worker`` takes new requests again; 409 ``worker_busy`` while it switches roles."""
        self._check_still(worker, "resume")
        worker.draining = False

    def begin_switch(self, worker: Worker) -> None:
        """``worker`` starts a role switch: drained, and neither resumed nor removed until ``end_switch``."""
        self._check_still(worker, "switch")
        worker.draining = True
        self._moving.add(worker.id)

    def move(self, worker: Worker, role: str) -> None:
        """``worker`` (switching) now belongs to the ``role`` pool, and is exported under it."""
        if role not in self.pools or not self.switching(worker):
            raise ValueError(f"{worker.id} cannot move to {role!r}: only a switching worker moves, between pools")
        self.metrics.unwatch(worker)
        self.pools[worker.role].policy.forget(worker.name)
        worker.role = role
        self.metrics.watch([worker])

    def end_switch(self, worker: Worker) -> None:
        """The switch is over (done or given up): ``worker`` takes new requests again."""
        self._moving.discard(worker.id)
        worker.draining = False

    def _check_still(self, worker: Worker, what: str) -> None:
        if self.switching(worker):
            raise RouterError(409, f"{worker.id} is switching roles; {what} it once the split is applied",
                              code="worker_busy")
