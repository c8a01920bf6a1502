"""What switching switchable workers can reach, and who moves: the checks of ``POST /admin/ratio`` and
``POST /admin/workers/{id}/role`` and the choice of movers (``router.fleet.membership`` makes the
switches). Pure: workers' fields in, counts, moves or a ``RouterError`` out; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from router.errors import RouterError
from router.fleet.workers import Pool, Worker
from router.plan.ratio import ORDER, Movable

LETTERS = {"encoder": "e", "prefill": "n", "decode": "m"}  # a split's counts, as its error message names them


def check_split(split: Mapping[str, object], pools: Mapping[str, Sequence[Worker]]) -> dict[str, int]:
    """``split`` (a count for each role of ``pools``, in ``ORDER``) if switching can reach it: RouterError
    400 ``invalid_split`` unless each is an integer >= 1 and they add up to the pools' workers, 409
    ``split_unreachable`` unless each role keeps its fixed workers and gets no more than can take it."""
    roles = list(pools)
    counts = {role: n for role in roles if isinstance(n := split.get(role), int) and not isinstance(n, bool) and n >= 1}
    if len(counts) != len(roles) or set(split) != set(roles):
        shape = ", ".join(f'"{role}": {LETTERS[role]}' for role in roles)
        raise RouterError(400, f"a split is {{{shape}}}, each an integer >= 1", code="invalid_split")
    total = sum(len(workers) for workers in pools.values())
    if sum(counts.values()) != total:
        raise RouterError(400, f"the pool has {total} {_words(roles)} workers; {' + '.join(roles)} must be {total}, "
                          f"got {' + '.join(str(n) for n in counts.values())}", code="invalid_split")
    movable = movable_of(pools)
    if any(counts[role] < movable.fixed[role] for role in roles):
        fixed = _words([f"{movable.fixed[role]} {role}" for role in roles])
        bounds = _words([f"{role}{' must be' if i == 0 else ''} >= {movable.fixed[role]}"
                         for i, role in enumerate(roles)])
        raise RouterError(409, f"only switchable workers (stage serve pd) change roles: {fixed} workers are fixed, "
                          f"so {bounds}", code="split_unreachable")
    for role in (role for role in roles if counts[role] > movable.most[role]):
        raise RouterError(409, f"at most {movable.most[role]} workers can serve as {role}: {movable.fixed[role]} fixed "
                          f"and {movable.most[role] - movable.fixed[role]} switchable that can take the role (an EPD "
                          "switchable worker, stage serve pd --redis-url, can be an encoder)", code="split_unreachable")
    return counts


def movable_of(pools: Mapping[str, Sequence[Worker]]) -> Movable:
    """The workers of ``pools`` (the roles a split moves between) in numbers (``router.plan.ratio.Movable``)."""
    switchable = [w for workers in pools.values() for w in workers if w.switchable]
    fixed = {role: sum(not w.switchable for w in workers) for role, workers in pools.items()}
    return Movable(current={role: len(workers) for role, workers in pools.items()}, fixed=fixed,
                   most={role: fixed[role] + sum(role in w.roles or role == w.role for w in switchable)
                         for role in pools})


def movers(split: Mapping[str, int], pools: Mapping[str, Sequence[Worker]]) -> list[tuple[Worker, str]]:
    """Who switches to which role to reach ``split`` (``check_split`` passed): for each role that
    grows, the encoder first (fewer workers can take it), one at a time the least loaded switchable
    worker, not drained, of a role that shrinks and still has too many, that can take it. RouterError
    409 ``split_unreachable`` when too few such workers are there."""
    surplus = {role: len(pools[role]) - n for role, n in split.items() if len(pools[role]) > n}
    free = [w for role in surplus for w in pools[role] if w.switchable and not w.draining]
    for role, count in surplus.items():
        if (have := sum(w.role == role for w in free)) < count:
            raise RouterError(409, f"{count} {role} worker(s) must switch, but only {have} are switchable and not "
                              "drained (resume drained ones first)", code="split_unreachable")
    moves: list[tuple[Worker, str]] = []
    for role in (role for role in ORDER if split.get(role, 0) > len(pools.get(role, ()))):
        for _ in range(split[role] - len(pools[role])):
            able = [w for w in free if role in w.roles and surplus[w.role] > 0]
            if not able:
                raise RouterError(409, f"{split[role] - len(pools[role])} worker(s) must switch to {role}, but only "
                                  f"{sum(to == role for _, to in moves)} switchable worker(s) not drained can take it",
                                  code="split_unreachable")
            mover = min(able, key=lambda w: (w.outstanding, w.id))
            free.remove(mover)
            surplus[mover.role] -= 1
            moves.append((mover, role))
    return moves


def check_switch(worker: Worker, role: object, pools: Mapping[str, Pool]) -> str | None:
    """The role ``worker`` may switch to alone, or None when it serves ``role`` already. RouterError:
    400 ``invalid_role`` for a role this router has no pool for or ``worker`` cannot take; 409
    ``worker_not_switchable`` for a fixed worker, ``worker_busy`` for a drained or switching one,
    ``split_unreachable`` when it is the only worker of its role."""
    if not isinstance(role, str) or role not in pools or role not in ORDER:
        raise RouterError(400, f"role must be one of {', '.join(r for r in pools if r in ORDER)}, got {role!r}",
                          code="invalid_role", param="role")
    if role == worker.role:
        return None
    if not worker.switchable:
        raise RouterError(409, f"{worker.id} ({worker.role} {worker.url}) is not a switchable worker (stage serve "
                          "pd): it keeps its role", code="worker_not_switchable")
    if role not in worker.roles:
        raise RouterError(400, f"{worker.id} can take the roles {', '.join(worker.roles)}, not {role} (an EPD "
                          "switchable worker, stage serve pd --redis-url, can be an encoder)",
                          code="invalid_role", param="role")
    if worker.draining:
        raise RouterError(409, f"{worker.id} is draining or switching; resume it first (POST /admin/workers/"
                          f"{worker.id}/resume)", code="worker_busy")
    if len(pools[worker.role].workers) == 1:
        raise RouterError(409, f"{worker.id} is the only {worker.role} worker: switching it would leave none",
                          code="split_unreachable")
    return role


def _words(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join([", ".join(items[:-1]), items[-1]]) if len(items) > 1 else "".join(items)
