"""``router.metrics.LoopHistogram`` renders exactly as prometheus_client's ``Histogram`` does for the
same observations (bucket bounds inclusive, cumulative counts, the sum), labelled or not, minus the
``_created`` series."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from router.metrics import LoopHistogram

pytestmark = pytest.mark.unit

BUCKETS = (0.005, 0.01, 0.5, 10.0)
VALUES = [0.0, 0.005, 0.0050001, 0.01, 0.3, 0.5, 9.99, 10.0, 10.5, 1e9, -1.0]


def rendered(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


@pytest.mark.parametrize("labels", [(), ("stage",)])
def test_a_loop_histogram_renders_as_prometheus_clients(labels):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopHistogram("h_seconds", "help text", labels, BUCKETS, registry=ours)
    reference = Histogram("h_seconds", "help text", labels, buckets=BUCKETS, registry=theirs)
    for i, value in enumerate(VALUES):
        if labels:
            mine.labels(stage=("prefill", "decode")[i % 2]).observe(value)
            reference.labels(stage=("prefill", "decode")[i % 2]).observe(value)
        else:
            mine.observe(value)
            reference.observe(value)
    assert rendered(ours) == rendered(theirs)
    if not labels:  # -1.0, 0.0 and 0.005: a bound is inclusive
        assert 'h_seconds_bucket{le="0.005"} 3.0' in rendered(ours)


def test_an_unobserved_labelled_series_renders_at_zero():
    registry = CollectorRegistry()
    LoopHistogram("h_seconds", "help text", ("stage",), BUCKETS, registry=registry).labels(stage="encoder")
    lines = rendered(registry)
    assert 'h_seconds_count{stage="encoder"} 0.0' in lines and 'h_seconds_sum{stage="encoder"} 0.0' in lines
