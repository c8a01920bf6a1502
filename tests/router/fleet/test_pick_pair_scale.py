"""``pick_pair`` at fleet scale: which decodes have a partner takes O(P + D) pairability checks when
the pairing rules split the fleet into groups, not O(P x D) (``workers.with_partner``); the answer is
the one a scan of every pair gives."""

from __future__ import annotations

import pytest

from router.fleet.breaker import CircuitBreaker
from router.fleet.pairing import Pairing, PairingRules
from router.fleet.workers import Pool, Worker, pick_pair, with_partner
from router.plan.policy import RoundRobin

pytestmark = pytest.mark.unit
FP = {"model": "m", "block_size": 16}


def fleet(n: int, role: str, groups: str) -> list[Worker]:
    return [Worker(f"http://{role}:{i}", role, CircuitBreaker(3, 10.0), healthy=True, known=True, models=("m",),
                   fingerprint=dict(FP), bootstrap=("h", i), group=groups[i * len(groups) // n]) for i in range(n)]


def test_with_partner_checks_each_decode_against_a_few_prefills_when_groups_split_the_fleet():
    pairing = Pairing(PairingRules("group"))
    prefills, decodes = fleet(256, "prefill", "ab"), fleet(256, "decode", "abc")  # group c: no prefill
    calls = 0

    def pairable(p: Worker, d: Worker) -> bool:
        nonlocal calls
        calls += 1
        return pairing.pairable(p, d)

    got = with_partner(decodes, prefills, pairable)
    assert got == [d for d in decodes if any(pairing.pairable(p, d) for p in prefills)]
    assert {d.group for d in got} == {"a", "b"}
    # a scan per decode would be ~256 x 170; each group-c decode still scans (no partner exists)
    assert calls < 256 * 3 + 86 * 258


def test_with_partner_scans_again_when_no_partner_so_far_fits_and_keeps_order():
    pairing = Pairing(PairingRules("group"))
    prefills, decodes = fleet(4, "prefill", "ab"), fleet(6, "decode", "ba")
    decodes.reverse()
    assert with_partner(decodes, prefills, pairing.pairable) == decodes
    assert with_partner(decodes, [], pairing.pairable) == []


def test_pick_pair_pairs_within_each_group_at_scale():
    members = [*fleet(64, "prefill", "ab"), *fleet(64, "decode", "ab")]
    pairing = Pairing(PairingRules("group"))
    prefills, decodes = Pool("prefill", members, RoundRobin()), Pool("decode", members, RoundRobin())
    pairs = [pick_pair(prefills, decodes, "m", (), pairing.pairable) for _ in range(64)]
    assert all(p is not None and p[0].group == p[1].group for p in pairs)
    assert {p[1].url for p in pairs if p is not None} == {d.url for d in decodes.workers}
