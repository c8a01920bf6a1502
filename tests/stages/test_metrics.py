"""A stage's metrics (stages/metrics.py): one registry per app, a request counted once whatever
finishes it."""

from __future__ import annotations

import pytest

from stages.metrics import Metrics

pytestmark = pytest.mark.unit


def test_metrics_registries_are_per_app_and_requests_count_once():
    first, second = Metrics(), Metrics()  # a process-global registry would refuse the second
    timer = first.timer()
    timer.tokens(1)
    timer.finish("length", 10, 4)
    timer.finish("abort", 10, 4)
    first.observe_step(3, 0.01)
    text = first.render().decode()
    assert 'epd_requests_total{finish_reason="length"} 1.0' in text
    assert 'epd_requests_total{finish_reason="abort"} 0.0' in text
    assert "epd_batch_size_sum 3.0" in text
    assert 'epd_requests_total{finish_reason="length"} 0.0' in second.render().decode()
