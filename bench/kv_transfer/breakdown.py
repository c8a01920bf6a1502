"""Our layer's parts timed in isolation on one cell's ids and ops (block_ops, coalesce + check,
address lists, the worker-thread hop; NIXL: descriptor building, the sleeps of the poll), and the raw
NIXL write split into its calls."""

from __future__ import annotations

import statistics
import time

from bench.kv_transfer.paths import Paths


def micro(fn, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def breakdown(paths: Paths, iters: int) -> dict:
    """Our layer's parts, timed in isolation on this cell's ids and ops (median microseconds)."""
    from transfer.base import check_ops
    from transfer.ops import block_ops, coalesce

    backend, peer = paths.backend, paths.peer
    out = {
        "block_ops_us": micro(lambda: block_ops(paths.local_ids, paths.remote_ids, paths.block_bytes), iters),
        "coalesce_and_check_us": micro(lambda: check_ops(coalesce(paths.ops), backend.region[1], peer.length), iters),
    }
    if backend.name == "mooncake":
        calls = backend._calls
        base = backend.region[0]
        out["address_lists_us"] = micro(lambda: ([base + op.local_offset for op in paths.ops],
                                                 [peer.base + op.remote_offset for op in paths.ops],
                                                 [op.length for op in paths.ops]), iters)
        out["worker_thread_hop_us"] = micro(lambda: calls.call(lambda: 0, time.monotonic() + 10, "noop"), iters)
    else:
        import nixl._bindings as nb
        import numpy as np

        base = backend.region[0]

        def descs():
            table = np.array([(op.local_offset, op.remote_offset, op.length) for op in paths.ops], dtype=np.uint64)
            zeros = np.zeros(len(paths.ops), dtype=np.uint64)
            local = np.stack([table[:, 0] + np.uint64(base), table[:, 2], zeros], axis=1)
            remote = np.stack([table[:, 1] + np.uint64(peer.base), table[:, 2], zeros], axis=1)
            return nb.nixlXferDList(nb.DRAM_SEG, local), nb.nixlXferDList(nb.DRAM_SEG, remote)

        out["descriptor_build_us"] = micro(descs, iters)
        out["raw_prebuilt_arrays_dlist_us"] = micro(lambda: (nb.nixlXferDList(nb.DRAM_SEG, paths.local_descs),
                                                             nb.nixlXferDList(nb.DRAM_SEG, paths.remote_descs)), iters)
        # what a sleep in the poll loop really costs on this (possibly busy) core
        out["sleep_20us_actual_us"] = micro(lambda: time.sleep(20e-6), max(10, iters // 4))
        out["sleep_1ms_actual_us"] = micro(lambda: time.sleep(1e-3), max(10, iters // 10))
    result = {k: round(v * 1e6, 1) for k, v in out.items()}
    if backend.name == "nixl":
        result["raw_phases"] = nixl_phases(paths, max(5, iters // 20))
    return result


def nixl_phases(paths: Paths, iters: int) -> dict:
    """The raw NIXL write split into its calls (median us): descriptor lists + createXferReq, postXferReq,
    the busy poll until done (and how many getXferStatus calls), releaseXferReq."""
    import nixl._bindings as nb

    agent, ucx = paths.backend._agent, paths.backend._ucx
    rows = []
    for _ in range(iters):
        t0 = time.perf_counter()
        handle = agent.createXferReq(nb.NIXL_WRITE, nb.nixlXferDList(nb.DRAM_SEG, paths.local_descs),
                                     nb.nixlXferDList(nb.DRAM_SEG, paths.remote_descs), paths.peer.key, "", [ucx])
        t1 = time.perf_counter()
        status = agent.postXferReq(handle, "")
        t2 = time.perf_counter()
        done_at_post = status == nb.NIXL_SUCCESS
        polls = 0
        while status == nb.NIXL_IN_PROG:
            status = agent.getXferStatus(handle)
            polls += 1
        t3 = time.perf_counter()
        agent.releaseXferReq(handle)
        t4 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, polls, done_at_post))
    def med(i: int) -> float:
        return round(1e6 * statistics.median(r[i] for r in rows), 1)

    return {"create_us": med(0), "post_us": med(1), "poll_until_done_us": med(2), "release_us": med(3),
            "polls": int(statistics.median(r[4] for r in rows)), "done_at_post": sum(r[5] for r in rows),
            "iters": iters}


