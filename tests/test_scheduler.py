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
    """Pretend the step ran: prefilled requests keep running, the named ones finish."""
    batch = scheduler.schedule()
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


def test_first_prompt_larger_than_budget_runs_alone():
    scheduler = make_scheduler(num_blocks=64, max_batched_tokens=8)
    scheduler.add(make_request("long", 30))
    scheduler.add(make_request("short", 2))
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.prefills] == ["long"]


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
