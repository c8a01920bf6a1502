"""bench/kv_link/: the pure parts (the cells, the pools, the repetitions, the ratios against raw TCP,
the limit, the link check, the goal, the summary's figures, /proc/net/dev) and one ``--quick`` run
end to end on the multi-host rig (as root; ~10-15 s): KV over a veth link through our layer, the raw
library and a plain socket, every path's bytes checked and seen on the link, no namespace left."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from bench.kv_link.analysis import GOAL_RATIO, cell_ratios, crossed_link, goal, limit
from bench.kv_link.report import figures
from bench.kv_link.worker import link_tx_bytes, pieces, tcp_active_opens
from bench.kv_link.workload import Cell, blocks_for, cells, pool_blocks, reps_for
from tests.conftest import REPO
from tests.support.generated_models import model_dir

MIB = 1 << 20
BLOCK = 128 * 1024  # the small model's block


def path(median_ms, min_ms=None):
    return {"median_ms": median_ms, "min_ms": min_ms or median_ms}


@pytest.mark.unit
def test_sizes_are_whole_blocks_and_the_pools_hold_twice_the_largest():
    assert (blocks_for(16, BLOCK), blocks_for(64, BLOCK)) == (128, 512)
    with pytest.raises(ValueError, match="not a whole number of 3000-byte blocks"):
        blocks_for(16, 3000)
    assert pool_blocks([16, 64], BLOCK) == 1024


@pytest.mark.unit
def test_cells_are_a_contiguous_run_and_a_fragmented_sample_per_size():
    from transfer.ops import block_ops

    contiguous, fragmented = cells([16], ["contiguous", "fragmented"], BLOCK, 1024, random.Random(0))
    assert (contiguous.mib, contiguous.layout, contiguous.blocks) == (16, "contiguous", 128)
    assert contiguous.remote_ids == tuple(range(893, 1021)) and contiguous.local_ids == list(range(128))
    assert len(block_ops(contiguous.local_ids, list(contiguous.remote_ids), BLOCK)) == 1
    assert len(set(fragmented.remote_ids)) == 128 and max(fragmented.remote_ids) < 1024
    assert len(block_ops(fragmented.local_ids, list(fragmented.remote_ids), BLOCK)) == 128
    with pytest.raises(ValueError, match="layout is one of"):
        cells([16], ["striped"], BLOCK, 1024, random.Random(0))


@pytest.mark.unit
def test_large_cells_get_two_thirds_of_the_repetitions():
    assert (reps_for(30, 16), reps_for(30, 64), reps_for(3, 64)) == (30, 20, 3)


@pytest.mark.unit
def test_ratios_are_the_references_time_over_the_paths():
    ratios = cell_ratios({"ours": path(20.0, 16.0), "raw": path(19.0, 15.2), "tcp": path(17.0, 12.0)})
    assert ratios == {"ours_vs_tcp": 0.85, "raw_vs_tcp": 0.895, "ours_vs_raw": 0.95, "ours_vs_tcp_best": 0.75,
                      "raw_vs_tcp_best": 0.789, "ours_vs_raw_best": 0.95, "limit": None}


@pytest.mark.unit
@pytest.mark.parametrize(("ours_vs_tcp", "raw_vs_tcp", "ours_vs_raw", "why"), [
    (0.8, 0.5, 1.6, None),  # the goal is met: no limit, whatever the library does
    (0.7, 0.72, 0.97, "library"),  # the library itself is slow; our layer keeps 0.97 of it
    (0.6, 0.9, 0.67, "our layer"),  # the library meets the goal, ours does not
    (0.5, 0.7, 0.71, "library and our layer"),
    (0.794, 0.801, 0.992, "neither alone"),  # both within their margins, the product just below
])
def test_the_limit_names_what_holds_ours_below_the_goal(ours_vs_tcp, raw_vs_tcp, ours_vs_raw, why):
    assert limit(ours_vs_tcp, raw_vs_tcp, ours_vs_raw) == why


@pytest.mark.unit
def test_a_path_crossed_the_link_when_at_least_its_payload_went_out():
    assert crossed_link(16 * MIB + 40_000, 16 * MIB, tcp_opens=2) == {
        "wire_bytes": 16 * MIB + 40_000, "wire_ratio": 1.002, "over_link": True, "tcp_opens": 2}
    assert crossed_link(1200, 16 * MIB)["over_link"] is False  # shared memory: only the control messages
    assert crossed_link(0, 0)["over_link"] is False


def _cell(mib, layout, ours, raw, lim=None, wire=True):
    return {"mib": mib, "layout": layout, "ours_vs_tcp": ours, "raw_vs_tcp": raw, "ours_vs_raw": round(ours / raw, 3),
            "limit": lim, "paths": {"tcp": {"gbps": 1.1}},
            "wire": {p: {"over_link": wire or p == "tcp"} for p in ("ours", "raw", "tcp")}}


@pytest.mark.unit
def test_the_goal_names_the_cells_below_it_and_paths_off_the_link():
    results = [{"backend": "mooncake", "cells": [_cell(16, "contiguous", 0.95, 0.97),
                                                 _cell(64, "fragmented", 0.7, 0.72, "library")]},
               {"backend": "nixl", "cells": [_cell(16, "contiguous", 1.3, 1.9, wire=False)]}]
    assert goal(results) == {
        "ours_vs_tcp": GOAL_RATIO, "met": False,
        "ratios": {"mooncake/16MiB/contiguous": 0.95, "mooncake/64MiB/fragmented": 0.7, "nixl/16MiB/contiguous": 1.3},
        "below": {"mooncake/64MiB/fragmented": {"ours_vs_tcp": 0.7, "raw_vs_tcp": 0.72, "ours_vs_raw": 0.972,
                                                "limit": "library"}},
        "not_over_link": ["nixl/16MiB/contiguous/ours", "nixl/16MiB/contiguous/raw"]}
    assert goal([{"backend": "nixl", "cells": [_cell(16, "contiguous", 0.9, 0.7)]}])["met"] is True


@pytest.mark.unit
def test_figures_keep_ours_and_the_library_against_tcp_and_tcps_bandwidth():
    results = [{"backend": "nixl", "cells": [_cell(64, "contiguous", 0.93, 1.1)]}]
    assert [(f.name, f.value, f.unit) for f in figures(results)] == [
        ("nixl, 64 MiB contiguous: ours / raw TCP", 0.93, "x"),
        ("nixl, 64 MiB contiguous: raw library / raw TCP", 1.1, "x"),
        ("nixl, 64 MiB contiguous: raw TCP", 1.1, "GB/s")]


@pytest.mark.unit
def test_link_bytes_are_read_from_proc_net_dev():
    text = ("Inter-|   Receive                                                |  Transmit\n"
            " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls "
            "carrier compressed\n"
            "    lo:     100       1    0    0    0     0          0         0      100       1    0    0    0     0 "
            "      0          0\n"
            "  eth0: 5000000    3000    0    0    0     0          0         0 17000000   12000    0    0    0     0 "
            "      0          0\n")
    assert link_tx_bytes(text) == 17_000_000 and link_tx_bytes(text, "lo") == 100
    with pytest.raises(ValueError, match="no interface 'eth1'"):
        link_tx_bytes(text, "eth1")


@pytest.mark.unit
def test_the_tcp_path_moves_an_op_in_pieces_of_at_most_the_chunk():
    assert pieces(1000, 300, 128) == [(1000, 1128), (1128, 1256), (1256, 1300)]
    assert pieces(0, 256, 128) == [(0, 128), (128, 256)]
    assert pieces(5, 0, 128) == []


@pytest.mark.unit
def test_tcp_connections_opened_are_read_from_proc_net_snmp():
    text = ("Ip: Forwarding DefaultTTL\nIp: 1 64\n"
            "Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails\n"
            "Tcp: 1 200 120000 -1 54005 31884 22084\nUdp: InDatagrams\nUdp: 7\n")
    assert tcp_active_opens(text) == 54005


@pytest.mark.timeout(180)
def test_quick_run_moves_kv_over_the_rig_link_on_every_path(tmp_path):
    out = tmp_path / "kv_link.json"
    run = subprocess.Popen([sys.executable, "-m", "bench.kv_link", "--quick", "--model-dir", str(model_dir("qwen2_vl")),
                            "--out", str(out), "--summary-dir", str(tmp_path / "summaries")],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = run.communicate(timeout=150)
    finally:
        run.kill()
    assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["backend"] for r in report["results"]] == ["mooncake", "nixl"]
    assert [r["env"] for r in report["results"]] == [{}, {"UCX_TLS": "tcp"}]
    for result in report["results"]:
        [cell] = result["cells"]
        assert (cell["mib"], cell["layout"], cell["ops"], cell["bytes"], cell["verified"]) == (16, "contiguous", 1,
                                                                                                16 * MIB, True)
        assert {p: w["over_link"] for p, w in cell["wire"].items()} == {"ours": True, "raw": True, "tcp": True}
        assert all(w["wire_ratio"] < 1.2 for w in cell["wire"].values())  # one move's bytes, plus headers
        assert cell["wire"]["tcp"]["tcp_opens"] == 0  # the socket path keeps its one connection
        assert {p: r["n"] for p, r in cell["paths"].items()} == {"ours": 5, "raw": 5, "tcp": 5}
    assert set(report["goal"]["ratios"]) == {"mooncake/16MiB/contiguous", "nixl/16MiB/contiguous"}
    [summary_path] = (tmp_path / "summaries").iterdir()
    summary = json.loads(summary_path.read_text())
    assert [(f["name"], f["unit"]) for f in summary["figures"]] == [
        (f"{backend}, 16 MiB contiguous: {what}", unit) for backend in ("mooncake", "nixl")
        for what, unit in (("ours / raw TCP", "x"), ("raw library / raw TCP", "x"), ("raw TCP", "GB/s"))]
    assert f"goal ours / raw TCP >= {GOAL_RATIO}" in stdout
    netns = os.listdir("/var/run/netns") if os.path.isdir("/var/run/netns") else []
    left = [name for name in netns if name.startswith(f"emh{run.pid}x")]  # the run's rig, by its creator's pid
    assert not left, f"namespaces left behind: {left}"
