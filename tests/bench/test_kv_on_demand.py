"""The pure parts of bench/kv_on_demand/: the output lengths, the ratios bench/README.md quotes and the
summary's figures."""

from __future__ import annotations

import pytest

from bench.kv_on_demand.report import figures, ratios
from bench.kv_on_demand.run import messages, output_lengths

pytestmark = pytest.mark.unit


def test_output_lengths_are_seeded_and_within_a_quarter_of_the_mean():
    lengths = output_lengths(200, 64)
    assert lengths == output_lengths(200, 64) and min(lengths) >= 48 and max(lengths) <= 80
    assert len(set(lengths)) > 10 and messages(0) != messages(1)


def test_ratios_and_figures():
    on_demand = {"max_running": 60, "mean_running": 30.0, "seconds": 10.0, "preemptions": {"recompute": 5, "swap": 0}}
    reserve = {"max_running": 7, "mean_running": 6.0, "seconds": 40.0, "preemptions": {"recompute": 0, "swap": 0}}
    ratio = ratios(on_demand, reserve)
    assert ratio == {"max_running": 8.57, "mean_running": 5.0, "serve_time_reserve_over_on_demand": 4.0}
    assert [(f.value, f.unit) for f in figures(on_demand, reserve, ratio, same=True)] == [
        (60, "requests"), (7, "requests"), (8.57, "x"), (4.0, "x"), (5, "preemptions"), (1.0, "all (1) / not (0)")]
