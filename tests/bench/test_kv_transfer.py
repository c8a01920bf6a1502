"""The pure parts of bench/kv_transfer/: a path's timing summary, ours / raw and each path / memcpy
(bandwidth ratios: the ones bench/README.md quotes), the split of ours - raw, the goal, the remote
block lists, the repetitions per cell and the summary's figures."""

from __future__ import annotations

import random

import pytest

from bench.kv_transfer.analysis import GOAL_RATIO, cell_ratios, goal, summarize
from bench.kv_transfer.layout import fragmented_ids, reps_for
from bench.kv_transfer.report import figures
from transfer.ops import block_ops

pytestmark = pytest.mark.unit

MIB = 1 << 20


def path(median_ms, min_ms=None):
    return {"median_ms": median_ms, "min_ms": min_ms or median_ms}


def test_summarize_times_a_path_in_ms_and_gb_per_s():
    s = summarize([0.004, 0.002, 0.003, 0.010], 16 * MIB)
    assert (s["n"], s["median_ms"], s["p90_ms"], s["min_ms"]) == (4, 3.5, 10.0, 2.0)
    assert s["gbps"] == round(16 * MIB / 0.0035 / 1e9, 3) and s["gbps_p90_time"] == round(16 * MIB / 0.01 / 1e9, 3)


def test_ours_over_raw_is_raws_time_over_ours():
    res = {"ours": path(10.0, 9.0), "raw": path(9.4, 8.1), "raw_in_thread": path(9.6), "memcpy": path(1.5)}
    ratios = cell_ratios(res)
    assert (ratios["ratio_ours_vs_raw"], ratios["ratio_ours_vs_raw_best"]) == (0.94, 0.9)
    assert ratios["ratio_vs_memcpy"] == {"ours": 0.15, "raw": 0.16, "raw_in_thread": 0.156}
    assert ratios["ours_minus_raw_us"] == 600.0
    assert ratios["split_us"] == {"thread_hop": 200.0, "rest_of_layer": 400.0}
    assert "split_us" not in cell_ratios({"ours": path(2.0), "raw": path(2.0), "memcpy": path(1.0)})


def test_the_goal_names_the_cells_below_it():
    results = [{"backend": "nixl", "cells": [{"tokens": 2048, "layout": "contiguous", "ratio_ours_vs_raw": 0.95},
                                             {"tokens": 8192, "layout": "fragmented", "ratio_ours_vs_raw": 0.885}]}]
    assert goal(results) == {"ratio_ours_vs_raw": GOAL_RATIO, "met": False,
                             "ratios": {"nixl/2048/contiguous": 0.95, "nixl/8192/fragmented": 0.885},
                             "below": {"nixl/8192/fragmented": 0.885}}


def test_fragmented_ids_give_one_op_per_block():
    ids = fragmented_ids(64, 128, random.Random(0), block_bytes=4096)
    assert len(set(ids)) == 64 and all(0 <= i < 128 for i in ids)
    assert len(block_ops(list(range(64)), ids, 4096)) == 64


def test_small_cells_get_more_repetitions_and_large_ones_fewer():
    assert (reps_for(40, 4 * MIB), reps_for(40, 16 * MIB), reps_for(40, 64 * MIB), reps_for(3, 64 * MIB)) == \
        (160, 40, 26, 3)


def test_figures_keep_ours_over_raw_and_memcpy_at_16_and_64_mib():
    cell = {"layout": "contiguous", "ratio_ours_vs_raw": 0.97, "ratio_vs_memcpy": {"ours": 0.2}}
    results = [{"backend": "mooncake", "cells": [{**cell, "tokens": 512, "bytes": 4 * MIB},
                                                 {**cell, "tokens": 2048, "bytes": 16 * MIB}]}]
    assert [(f.name, f.value) for f in figures(results)] == [
        ("mooncake, 2048 tokens (16 MiB), contiguous: ours / raw", 0.97),
        ("mooncake, 2048 tokens (16 MiB), contiguous: ours / memcpy", 0.2)]
