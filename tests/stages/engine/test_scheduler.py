"""The scheduler alone: admission under a token budget and a block pool, ordering, release; KV on
demand: growth a block at a time, the watermark, preemption (LIFO victims, readmission first, recompute
and swap) and the reservation baseline."""

import pytest

from stages.engine.block_allocator import BlockAllocator
from stages.engine.multimodal import Prompt
from stages.engine.request import FinishReason, Preemption, Request, RequestStatus
from stages.engine.sampling_params import SamplingParams
from stages.engine.scheduler import Scheduler

pytestmark = pytest.mark.unit


def make_request(name: str, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(name, Prompt(token_ids=list(range(prompt_len))), SamplingParams(max_tokens=max_tokens))


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, max_batched_tokens=32,
                   kv_allocation="on_demand") -> Scheduler:
    return Scheduler(BlockAllocator(num_blocks, block_size), max_num_seqs, max_batched_tokens, kv_allocation)


def run_step(scheduler: Scheduler, finished: set[str] = frozenset()):
    """Pretend the step ran as the runner and the engine do (each prefill computes its chunk, each
    decode one token; each that yields a token appends one); the named requests finish."""
    batch = scheduler.schedule()
    assert batch.num_tokens <= scheduler.max_batched_tokens
    for request in batch.decodes:  # each decode's next slot is in its blocks
        assert len(request.blocks) * scheduler.allocator.block_size > request.num_computed
    for request in batch.prefills:
        request.num_computed = request.chunk_end
        if request.prompt_done:
            request.output_ids.append(len(request.output_ids))
    for request in batch.decodes:
        request.num_computed += 1
        request.output_ids.append(len(request.output_ids))
    for request in batch.requests:
        if request.request_id in finished:
            request.finish(FinishReason.LENGTH)
    scheduler.after_step(batch)
    return batch


def test_reserve_takes_blocks_for_prompt_and_all_output_tokens():
    scheduler = make_scheduler(block_size=4, kv_allocation="reserve")
    request = make_request("a", prompt_len=5, max_tokens=8)  # 5 + 8 - 1 = 12 slots -> 3 blocks
    scheduler.add(request)
    batch = scheduler.schedule()
    assert batch.prefills == [request] and len(request.blocks) == 3
    assert request.status is RequestStatus.RUNNING and scheduler.watermark == 0
    for _ in range(7):
        run_step(scheduler)
    assert len(request.blocks) == 3 and scheduler.preemptions == {"recompute": 0, "swap": 0}


def test_on_demand_takes_the_prompt_blocks_then_one_block_as_each_fills():
    scheduler = make_scheduler(block_size=4)
    request = make_request("a", prompt_len=5, max_tokens=20)
    scheduler.add(request)
    held = []
    for _ in range(9):
        run_step(scheduler)
        held.append(len(request.blocks))
    # slots 0-4 (prompt) -> 2 blocks; the decode of slot 8 takes a third, that of slot 12 a fourth
    assert request.num_computed == 13 and held == [2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert scheduler.allocator.num_used == 4


def test_watermark_holds_admission_back_but_not_growth_nor_a_request_alone():
    scheduler = make_scheduler(num_blocks=10, block_size=4)
    assert scheduler.watermark == 1  # 1% of 10 blocks, at least one
    a, b, c = make_request("a", 16, 20), make_request("b", 20, 20), make_request("c", 4, 20)
    for request in (a, b, c):
        scheduler.add(request)
    batch = scheduler.schedule()
    assert batch.prefills == [a, b] and scheduler.allocator.num_free == 1  # c would leave 0 < 1 free
    assert list(scheduler.waiting) == [c]
    alone = make_scheduler(num_blocks=4, block_size=4)
    whole = make_request("whole", 13, max_tokens=4)  # 16 slots at most: the whole pool
    alone.add(whole)
    assert alone.schedule().prefills == [whole] and alone.allocator.num_free == 0


def grow_three_until_dry(scheduler: Scheduler) -> list[Request]:
    """Three requests of one block each in a 6-block pool, decoding until the pool runs dry."""
    requests = [make_request(name, 4, max_tokens=20) for name in "abc"]
    for request in requests:
        scheduler.add(request)
    run_step(scheduler)  # prefills: 3 blocks; first tokens
    for _ in range(4):  # slots 4-7: one more block each, 6 used
        assert not run_step(scheduler).preempted
    assert scheduler.allocator.num_free == 0
    return requests


def test_pool_running_dry_preempts_the_most_recently_admitted_and_keeps_its_tokens():
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    a, b, c = grow_three_until_dry(scheduler)
    outputs = list(c.output_ids)
    batch = run_step(scheduler)  # slot 8 for each: "a" takes "c"'s freed blocks, "b" the other
    assert batch.preempted == [c] and batch.decodes == [a, b] and batch.prefills == []
    assert c.status is RequestStatus.WAITING and c.blocks == [] and list(scheduler.waiting) == [c]
    assert c.output_ids == outputs and c.num_computed == 0 and c.prefill_len == 4 + len(outputs)
    assert scheduler.preemptions == {"recompute": 1, "swap": 0} and batch.swap_out == []
    assert len(a.blocks) == len(b.blocks) == 3 and scheduler.allocator.num_free == 0


def test_preempted_requests_come_back_first_in_admission_order_and_recompute_their_outputs():
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_batched_tokens=32)
    a, b, c = grow_three_until_dry(scheduler)
    run_step(scheduler)  # "c" preempted
    late = make_request("late", 2)
    scheduler.add(late)
    for _ in range(3):
        run_step(scheduler)
    batch = run_step(scheduler)  # slot 12: "a" needs a fourth block: "b" goes too
    assert batch.preempted == [b] and list(scheduler.waiting) == [b, c, late]
    batch = run_step(scheduler, finished={"a"})
    assert batch.decodes == [a] and scheduler.allocator.num_used == 0
    batch = run_step(scheduler)  # "b" over its prompt and its 9 outputs (4 blocks); "c" (3 more) waits
    assert batch.prefills == [b] and batch.chunks == [b.prefill_len] == [4 + 9] and len(b.blocks) == 4
    assert b.output_ids[-1] == 9 and b.prompt_done  # the recompute's logits gave it its next token
    assert list(scheduler.waiting) == [c, late]
    run_step(scheduler, finished={"b"})
    batch = run_step(scheduler)
    assert batch.prefills == [c, late] and batch.chunks == [4 + 5, 2] and c.output_ids[-1] == 5


def test_a_step_that_preempts_admits_nobody():
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    grow_three_until_dry(scheduler)
    scheduler.add(make_request("tiny", 1))
    batch = run_step(scheduler)
    assert batch.preempted and batch.prefills == [] and [r.request_id for r in scheduler.waiting] == ["c", "tiny"]


def test_swap_preemption_names_the_blocks_to_copy_out_and_in():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    first, second = make_request("first", 4, 12), make_request("second", 4, 12)
    for request in (first, second):  # as a decode server adds them: prompt KV written, first token known
        request.preemption = Preemption.SWAP
        request.blocks = scheduler.allocator.allocate(1)
        request.num_computed, request.output_ids = 4, [0]
        scheduler.add_running(request)
    for _ in range(4):  # slots 4-7: 4 blocks used
        run_step(scheduler)
    kv = list(second.blocks)
    batch = run_step(scheduler)
    assert batch.preempted == [second] and batch.swap_out == [(second, kv)] and second.swapped
    assert second.num_computed == 8 and scheduler.preemptions == {"recompute": 0, "swap": 1}
    batch = run_step(scheduler, finished={"first"})
    assert batch.decodes == [first] and batch.swap_in == []
    batch = run_step(scheduler)  # back in: its KV's 2 blocks and its next slot's, decoding this step
    assert batch.decodes == [second] and batch.prefills == [] and not second.swapped
    assert batch.swap_in == [(second, second.blocks[:2])] and len(second.blocks) == 3


def test_a_request_alone_beside_hand_off_blocks_preempts_itself_never_a_hand_off():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    hand_off = make_request("prefill", 8)
    hand_off.hand_off = True
    scheduler.add(hand_off)
    decoding = make_request("decode", 4, max_tokens=12)
    scheduler.add(decoding)
    run_step(scheduler)  # 2 + 1 blocks, 1 free (the watermark)
    assert hand_off.status is RequestStatus.RUNNING and decoding.prompt_done
    scheduler.running.remove(hand_off)  # as the engine does once it finished: its blocks now the caller's
    run_step(scheduler)  # slots 4..7 take the last block
    for _ in range(3):
        run_step(scheduler)
    batch = run_step(scheduler)  # slot 8: nothing left to take, nobody else to preempt
    assert batch.preempted == [decoding] and list(scheduler.waiting) == [decoding]
    scheduler.allocator.free(hand_off.blocks)  # the KV moved: the pool has room again
    assert run_step(scheduler).prefills == [decoding]


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
    assert long.blocks and len(long.blocks) == 8  # the prompt's, taken whole on admission: 30 / 4
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
    assert 0 < long.num_computed < long.prompt_len and scheduler.allocator.num_used == 8
    assert scheduler.abort("long") is long
    assert scheduler.allocator.num_used == 0 and not scheduler.has_work()


def test_reserve_waits_in_order_when_blocks_run_out_and_resumes_after_release():
    scheduler = make_scheduler(num_blocks=6, block_size=4, kv_allocation="reserve")
    first, second, third = (make_request(n, 7, max_tokens=3) for n in "abc")  # 9 slots = 3 blocks each
    for request in (first, second, third):
        scheduler.add(request)
    batch = run_step(scheduler)
    assert batch.prefills == [first, second] and scheduler.allocator.num_free == 0
    assert list(scheduler.waiting) == [third]
    batch = run_step(scheduler, finished={"a"})
    assert batch.prefills == [] and scheduler.allocator.num_free == 3
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
    scheduler = make_scheduler(num_blocks=4, block_size=4, kv_allocation="reserve")
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


def test_a_prefill_whose_images_are_coming_computes_up_to_the_first_it_needs_then_waits():
    """An EPD prefill's pending images (``Request.pending``: index -> placeholder span): the text before
    the first is computed at once, each span once its embedding is given, and a request with nothing
    to compute is out of the batch and not work (the engine thread sleeps)."""
    scheduler = make_scheduler(num_blocks=64, max_batched_tokens=8)
    request, other = make_request("epd", 24), make_request("other", 3)
    request.pending = {0: (5, 9), 1: (12, 20)}
    scheduler.add(request)
    scheduler.add(other)
    batch = run_step(scheduler)
    assert list(zip([r.request_id for r in batch.prefills], batch.chunks)) == [("epd", 5), ("other", 3)]
    assert request.num_computed == 5 and request.waits_for_inputs
    second = run_step(scheduler, finished={"other"})  # "other" decodes its last token; "epd" waits
    assert (second.prefills, second.decodes) == ([], [other])
    assert not scheduler.has_work() and not run_step(scheduler)
    del request.pending[1]  # the second image came first: still blocked by the first
    assert not scheduler.has_work()
    del request.pending[0]
    assert scheduler.has_work()
    assert [run_step(scheduler).chunks for _ in range(3)] == [[8], [8], [3]] and request.prompt_done


def test_a_pending_image_inside_the_prefix_hit_is_not_waited_for():
    request = make_request("hit", 20)
    request.pending = {0: (2, 6), 1: (10, 14)}
    request.num_computed = 8  # the prefix hit covers image 0 whole
    assert request.ready_len == 10
    request.num_computed = 12  # and image 1 in part: its span is still needed
    assert request.ready_len == 10 and request.waits_for_inputs
