"""The scheduler alone: admission under a token budget and a block pool, ordering, release."""

import pytest

from stages.engine.block_allocator import BlockAllocator
from stages.engine.multimodal import Prompt
from stages.engine.request import FinishReason, Request, RequestStatus
from stages.engine.sampling_params import SamplingParams
from stages.engine.scheduler import Scheduler


def make_request(name: str, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(name, Prompt(token_ids=list(range(prompt_len))), SamplingParams(max_tokens=max_tokens))


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, max_batched_tokens=32) -> Scheduler:
    return Scheduler(BlockAllocator(num_blocks, block_size), max_num_seqs, max_batched_tokens)


def run_step(scheduler: Scheduler, finished: set[str] = frozenset()):
    """Pretend the step ran as the runner does (each prefill computes its chunk, each decode one
    token); the named requests finish."""
    batch = scheduler.schedule()
    assert batch.num_tokens <= scheduler.max_batched_tokens
    for request in batch.prefills:
        request.num_computed = request.chunk_end
    for request in batch.decodes:
        request.num_computed += 1
    for request in batch.requests:
        if request.request_id in finished:
            request.finish(FinishReason.LENGTH)
    scheduler.after_step(batch)
    return batch


def test_blocks_reserved_for_prompt_and_all_output_tokens():
    scheduler = make_scheduler(block_size=4)
    request = make_request("a", prompt_len=5, max_tokens=4)  # 5 + 4 - 1 = 8 slots -> 2 blocks
    scheduler.add(request)
    batch = scheduler.schedule()
    assert batch.prefills == [request] and len(request.blocks) == 2
    assert request.status is RequestStatus.RUNNING


def test_decodes_come_first_then_prefills_within_budget():
    scheduler = make_scheduler(max_batched_tokens=20)
    running = make_request("run", 6)
    scheduler.add(running)
    run_step(scheduler)
    for name, length in (("a", 10), ("b", 9), ("c", 1)):
        scheduler.add(make_request(name, length))
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.decodes] == ["run"]
    # budget 20 - 1 decode = 19: "a" (10) fits, "b" (9) fits exactly, "c" waits for the next step
    assert [r.request_id for r in batch.prefills] == ["a", "b"]
    assert batch.num_tokens == 20


def test_prompt_longer_than_the_budget_is_prefilled_in_chunks():
    scheduler = make_scheduler(num_blocks=64, max_batched_tokens=8)
    long, short = make_request("long", 30), make_request("short", 2)
    scheduler.add(long)
    scheduler.add(short)
    chunks = []
    while not long.prompt_done:
        batch = run_step(scheduler)
        chunks.append([(r.request_id, n) for r, n in zip(batch.prefills, batch.chunks)])
    # 30 = 8 + 8 + 8 + 6; "short" takes what the last chunk leaves (it is admitted in order, after "long")
    assert chunks == [[("long", 8)], [("long", 8)], [("long", 8)], [("long", 6), ("short", 2)]]
    assert long.blocks and len(long.blocks) == 9  # reserved whole on admission: (30 + 4 - 1) / 4
    assert run_step(scheduler).decodes == [long, short]


def test_decodes_run_in_every_step_beside_a_chunk_and_the_budget_holds():
    scheduler = make_scheduler(num_blocks=64, max_batched_tokens=10)
    streams = [make_request(f"s{i}", 3, max_tokens=20) for i in range(3)]
    for request in streams:
        scheduler.add(request)
    run_step(scheduler)
    long = make_request("long", 40)
    scheduler.add(long)
    batches = []
    while not long.prompt_done:
        batches.append(run_step(scheduler))
    # each step: the 3 decodes, then 10 - 3 = 7 prompt tokens of "long": 40 = 5 x 7 + 5
    assert [b.decodes for b in batches] == [streams] * 6
    assert [b.num_tokens for b in batches] == [10] * 5 + [8]
    assert [b.chunks for b in batches] == [[7]] * 5 + [[5]]
    assert run_step(scheduler).decodes == [*streams, long]


def test_chunks_in_progress_go_before_new_prompts():
    scheduler = make_scheduler(num_blocks=64, max_batched_tokens=8)
    first = make_request("first", 12)
    scheduler.add(first)
    run_step(scheduler)  # 8 of 12
    second = make_request("second", 12)
    scheduler.add(second)
    batch = run_step(scheduler)
    assert batch.prefills == [first, second] and batch.chunks == [4, 4]


def test_decodes_that_fill_the_budget_hold_prefills_back():
    scheduler = make_scheduler(num_blocks=64, max_batched_tokens=2)
    a, b = make_request("a", 2, max_tokens=9), make_request("b", 2, max_tokens=9)
    scheduler.add(a)
    run_step(scheduler)
    scheduler.add(b)
    assert run_step(scheduler).prefills == [b]  # budget 2 - 1 decode = 1 token of "b"
    batch = run_step(scheduler)
    assert batch.decodes == [a] and batch.prefills == [b] and batch.chunks == [1]
    batch = run_step(scheduler)
    assert batch.decodes == [a, b] and batch.prefills == []
    scheduler.add(make_request("c", 2))
    assert run_step(scheduler).prefills == []  # no budget left: "c" waits


def test_request_in_chunked_prefill_counts_against_max_num_seqs():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=2, max_batched_tokens=8)
    scheduler.add(make_request("long", 12))
    scheduler.add(make_request("a", 2))
    scheduler.add(make_request("b", 2))
    run_step(scheduler)
    batch = run_step(scheduler)
    # "long" finishes its prompt (4) and "a" (2) fills the second seat: "b" waits with budget left
    assert [r.request_id for r in batch.prefills] == ["long", "a"] and batch.chunks == [4, 2]
    assert scheduler.num_waiting == 1


def test_abort_mid_chunking_frees_its_blocks():
    scheduler = make_scheduler(num_blocks=64, max_batched_tokens=8)
    long = make_request("long", 30)
    scheduler.add(long)
    run_step(scheduler)
    assert 0 < long.num_computed < long.prompt_len and scheduler.allocator.num_used == 9
    assert scheduler.abort("long") is long
    assert scheduler.allocator.num_used == 0 and not scheduler.has_work()


def test_waits_in_order_when_blocks_run_out_and_resumes_after_release():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    first, second, third = (make_request(n, 7, max_tokens=2) for n in "abc")  # 8 slots = 2 blocks each
    for request in (first, second, third):
        scheduler.add(request)
    batch = run_step(scheduler)
    assert batch.prefills == [first, second] and scheduler.allocator.num_free == 0
    assert list(scheduler.waiting) == [third]
    batch = run_step(scheduler, finished={"a"})
    assert batch.prefills == [] and scheduler.allocator.num_free == 2
    batch = run_step(scheduler)
    assert batch.prefills == [third] and batch.decodes == [second]


def test_request_that_can_never_fit_is_refused_up_front():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="needs 3 KV blocks .* pool has 2"):
        scheduler.add(make_request("big", 9, max_tokens=2))
    assert not scheduler.has_work()


def test_max_num_seqs_caps_the_batch():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=3)
    for i in range(5):
        scheduler.add(make_request(f"r{i}", 2))
    assert len(scheduler.schedule().prefills) == 3
    assert scheduler.num_waiting == 2


def test_abort_frees_blocks_wherever_the_request_is():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    running, waiting = make_request("run", 7, 2), make_request("wait", 7, 2)
    scheduler.add(running)
    run_step(scheduler)
    scheduler.add(make_request("other", 7, 2))
    scheduler.add(waiting)
    run_step(scheduler)
    assert scheduler.abort("run") is running and running.finish_reason is FinishReason.ABORT
    assert scheduler.abort("wait") is waiting and waiting.status is RequestStatus.FINISHED
    assert scheduler.abort("nobody") is None
    assert scheduler.allocator.num_used == 2  # only "other" holds blocks
    run_step(scheduler, finished={"other"})
    assert scheduler.allocator.num_used == 0 and not scheduler.has_work()


def test_status_only_moves_forward():
    request = make_request("a", 3)
    request.advance(RequestStatus.RUNNING)
    request.finish(FinishReason.STOP)
    with pytest.raises(ValueError, match="may not move from FINISHED to RUNNING"):
        request.advance(RequestStatus.RUNNING)
    request.finish(FinishReason.ABORT)
    assert request.finish_reason is FinishReason.STOP  # the first reason sticks


def test_add_running_skips_prefill():
    scheduler = make_scheduler()
    request = make_request("pd", 5)
    request.blocks = scheduler.allocator.allocate(2)
    request.num_computed, request.output_ids = 5, [7]
    scheduler.add_running(request)
    batch = scheduler.schedule()
    assert batch.decodes == [request] and batch.prefills == []
