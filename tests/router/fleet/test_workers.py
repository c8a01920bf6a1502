"""Workers and pairing (router/fleet/workers.py): incompatible prefill/decode pairs never picked
and reported, picks that skip unhealthy, open and excluded workers, leases counted and ended once,
a plan leased whole or not at all. Pure: no sockets."""

from __future__ import annotations

import pytest

from router.fleet.workers import fingerprint_diff, lease_all, pairing_report, pick_pair
from tests.support.router_workers import FP, pools, worker

pytestmark = pytest.mark.unit


def test_incompatible_pairs_are_never_picked_and_reported():
    p16, p32 = worker("http://p:1", "prefill"), worker("http://p:2", "prefill", {**FP, "block_size": 32})
    d16 = worker("http://d:1", "decode")
    prefills, decodes = pools([p16, p32], [d16])
    assert {pick_pair(prefills, decodes, None, ())[0].url for _ in range(6)} == {"http://p:1"}
    pairs, lines = pairing_report(prefills, decodes)
    assert pairs == 1 and lines == ["prefill http://p:2 and decode http://d:1 are never paired: their fingerprints "
                                    "differ (block_size: 32 != 16)"]
    assert pick_pair(prefills, decodes, None, {"http://p:1"}) is None
    assert fingerprint_diff(FP, None) == ["fingerprint: unknown"]


def test_pick_pair_skips_unhealthy_open_excluded_and_other_models():
    p = worker("http://p:1", "prefill")
    d1, d2, d3 = worker("http://d:1", "decode"), worker("http://d:2", "decode", healthy=False), \
        worker("http://d:3", "decode")
    d3.breaker.begin()
    d3.breaker.failure()  # open
    prefills, decodes = pools([p], [d1, d2, d3])
    assert {pick_pair(prefills, decodes, "m", ())[1].url for _ in range(4)} == {"http://d:1"}
    assert pick_pair(prefills, decodes, "other-model", ()) is None
    assert pick_pair(prefills, decodes, None, {"http://d:1"}) is None


def test_leases_count_outstanding_and_end_once():
    w = worker("http://d:1", "decode")
    lease = w.lease()
    assert lease is not None and w.outstanding == 1
    lease.failure()
    lease.cancel()  # already ended: nothing more
    assert w.outstanding == 0 and not w.breaker.allows()
    assert w.lease() is None and w.outstanding == 0  # the open circuit refuses: nothing counted


def test_a_plan_is_leased_whole_or_not_at_all():
    """A breaker that opened after the pick refuses at lease time: nothing is held, so the dispatcher
    plans again without that worker (no RuntimeError, no half-taken trial)."""
    p, d = worker("http://p:1", "prefill"), worker("http://d:1", "decode")
    leases = lease_all([d, p])
    assert leases is not None and (d.outstanding, p.outstanding) == (1, 1)
    for lease in leases:
        lease.success()
    p.breaker.begin()
    p.breaker.failure()  # open (threshold 1)
    assert lease_all([d, p]) is None
    assert (d.outstanding, p.outstanding) == (0, 0) and d.breaker.allows()
