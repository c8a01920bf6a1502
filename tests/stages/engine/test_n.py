"""``n`` sequences from one prompt in the engine (in-process, tiny model).

The prompt is computed once; the n sequences share its full KV blocks and each has its own copy of
the last, partial one. Greedy n=3 gives three copies of the n=1 answer; seeded sampled sequence i
gives, token for token, what a lone request seeded ``seed + i`` gives, colocated and on a decode
(``add_prefilled`` after a hand-off with n first tokens). The block counts show the sharing and go
back to 0 after the end and after an abort; a fork that finds no free block, and a fork preempted
on the way, still end with the right tokens. ``AsyncEngine.generate`` streams all n and an early
close aborts all n.

On ``EPD_TEST_DEVICE``: the CPU compares every token; a GPU the first few (a batch of n rows is a
different kernel shape from a lone request, which may part them at a near tie).
"""

from __future__ import annotations

import pytest

from stages.engine.async_engine import AsyncEngine
from stages.engine.block_allocator import BlockAllocator, blocks_for_tokens
from stages.engine.config import EngineConfig
from stages.engine.engine import Engine
from stages.engine.outputs import RequestOutput
from stages.engine.multimodal import Prompt
from stages.engine.request import FinishReason, Preemption, Request
from stages.engine.sampling_params import SamplingParams
from stages.engine.scheduler import Scheduler
from stages.engine.prefilled import FirstTokens, Prefilled
from stages.loading import load_engine
from stages.prompt import PromptBuilder
from tests.support.devices import DEVICE, on_gpu
from tests.support.generated_models import model_dir

MAX_STEPS = 400
SEED = 1234
COMPARED = 6 if on_gpu() else None  # tokens compared on a GPU (see the module docstring); all on the CPU


@pytest.fixture(scope="module")
def loaded() -> tuple[Engine, PromptBuilder]:
    return load_engine(EngineConfig(model=str(model_dir("qwen2_vl")), kv_cache_mib=16, device=DEVICE), pixels=True)


@pytest.fixture(scope="module")
def engine(loaded) -> Engine:
    return loaded[0]


@pytest.fixture(scope="module")
def prompt(loaded) -> Prompt:
    built = loaded[1].build([{"role": "user", "content": "tell me a story about a small green frog"}], [])
    assert len(built.token_ids) % loaded[0].allocator.block_size, "the test wants a partial last block"
    return built


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)


def seeded(max_tokens: int, n: int = 1, seed: int = SEED) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True, n=n)


def drain(engine: Engine, outputs: list[RequestOutput] | None = None) -> list[RequestOutput]:
    """Step until idle; every output (after ``outputs``), none failed."""
    outputs = list(outputs or [])
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            break
        outputs += engine.step()
    assert not engine.has_work(), "the engine did not finish"
    assert [o.error for o in outputs if o.error] == []
    return outputs


def by_index(outputs: list[RequestOutput], request_id: str, n: int) -> dict[int, list[int]]:
    """Each sequence's tokens, checking that each of the n finished once, with its last output."""
    tokens: dict[int, list[int]] = {i: [] for i in range(n)}
    done: set[int] = set()
    for output in (o for o in outputs if o.request_id == request_id):
        assert output.index not in done, f"sequence {output.index} has an output after its last"
        tokens[output.index] += output.token_ids
        if output.finished:
            done.add(output.index)
    assert done == set(range(n))
    return tokens


def assert_own_copies(engine: Engine, request_id: str) -> None:
    """Each sequence of ``request_id`` has the prompt's KV in its own last, partial prompt block."""
    sequences = engine.scheduler.sequences(request_id)
    full, used = divmod(sequences[0].prompt_len, engine.allocator.block_size)
    assert len({s.blocks[full] for s in sequences}) == len(sequences)
    expected = engine.pool.tensor[sequences[0].blocks[full], :, :, :used]
    assert expected.abs().sum() > 0
    for sequence in sequences[1:]:
        assert engine.pool.tensor[sequence.blocks[full], :, :, :used].equal(expected)


def run(engine: Engine, request_id: str, prompt: Prompt, params: SamplingParams) -> dict[int, list[int]]:
    engine.add_request(request_id, prompt, params)
    tokens = by_index(drain(engine), request_id, params.n)
    assert engine.allocator.num_used == 0
    return tokens


def same(got: list[int], expected: list[int]) -> None:
    assert len(got) == len(expected)
    assert got[:COMPARED] == expected[:COMPARED]


@pytest.fixture(scope="module")
def lone(engine, prompt) -> dict[int, list[int]]:
    """Sequence i's reference: a lone n=1 request seeded ``SEED + i`` (24 tokens)."""
    return {i: run(engine, f"lone-{i}", prompt, seeded(24, seed=SEED + i))[0] for i in range(4)}


def test_greedy_n3_gives_three_copies_of_the_n1_answer(engine, prompt):
    alone = run(engine, "greedy-1", prompt, greedy(12))[0]
    three = run(engine, "greedy-3", prompt, greedy(12, n=3))
    assert len(alone) == 12
    for i in range(3):
        same(three[i], alone)


def test_seeded_sequence_i_draws_what_a_lone_request_seeded_seed_plus_i_draws(engine, prompt, lone):
    three = run(engine, "seeded-3", prompt, seeded(24, n=3))
    for i in range(3):
        same(three[i], lone[i])
    assert len({tuple(lone[i]) for i in range(3)}) == 3  # the negative control: the seeds differ


def test_the_prompt_blocks_are_shared_and_given_back(engine, prompt):
    block_size, n = engine.allocator.block_size, 3
    full, prompt_blocks = len(prompt.token_ids) // block_size, blocks_for_tokens(len(prompt.token_ids), block_size)
    engine.add_request("shared", prompt, greedy(4, n=n))
    outputs = engine.step()  # the prefill: all n first tokens, the forks made
    assert sorted(o.index for o in outputs) == list(range(n)) and {o.request_id for o in outputs} == {"shared"}
    assert len({tuple(o.token_ids) for o in outputs}) == 1
    sequences = engine.scheduler.sequences("shared")
    assert [s.index for s in sequences] == list(range(n))
    assert all(s.blocks[:full] == sequences[0].blocks[:full] for s in sequences)  # shared, not copied
    assert_own_copies(engine, "shared")
    assert engine.allocator.num_used == prompt_blocks + (n - 1) * (prompt_blocks - full)
    drain(engine, outputs)
    assert engine.allocator.num_used == 0


def test_an_abort_mid_way_aborts_all_n_and_frees_every_block(engine, prompt):
    engine.add_request("aborted", prompt, seeded(40, n=4))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.sequences("aborted")) == 4 and engine.allocator.num_used > 0
    aborted = engine.abort("aborted")
    assert sorted(o.index for o in aborted) == [0, 1, 2, 3]
    assert {(o.request_id, o.finish_reason) for o in aborted} == {("aborted", FinishReason.ABORT)}
    assert engine.allocator.num_used == 0 and not engine.has_work() and engine.abort("aborted") == []
    run(engine, "aborted", prompt, greedy(2, n=4))  # the id is free again


def test_a_hand_off_with_n_gives_n_first_tokens_and_only_index_0_the_blocks(engine, prompt):
    engine.add_request("handed", prompt, seeded(24, n=3), hand_off=True)
    outputs = drain(engine)
    assert sorted(o.index for o in outputs) == [0, 1, 2]
    assert all(o.finish_reason is FinishReason.LENGTH and len(o.token_ids) == 1 for o in outputs)
    blocks = {o.index: o.blocks for o in outputs}
    assert blocks[1] is None and blocks[2] is None and blocks[0]
    assert engine.allocator.num_used == len(blocks[0])  # held for the transfer: the forks hold none
    engine.free_blocks(blocks[0])


def hand_off(engine: Engine, prompt: Prompt, params: SamplingParams) -> tuple[list[int], list[int], int]:
    """Prefill ``prompt`` as a prefill server does and move its KV into a reservation of the same
    engine as a decode server does; the reserved blocks, the n first tokens and the M-RoPE delta."""
    engine.add_request("prefill", prompt, params, hand_off=True)
    handed = sorted(drain(engine), key=lambda o: o.index)
    local = handed[0].blocks
    assert local is not None
    blocks = engine.reserve_blocks(prompt, params)
    engine.pool.tensor[blocks[: len(local)]] = engine.pool.tensor[local]
    engine.pool.tensor[local] = 0  # a fork reusing one of these blocks finds no stale copy of the prompt's
    engine.free_blocks(local)
    return blocks, [o.token_ids[0] for o in handed], handed[0].rope_delta


def test_a_decode_forks_after_add_prefilled_with_the_tokens_of_lone_requests(engine, prompt, lone):
    params = seeded(24, n=3)
    blocks, firsts, rope_delta = hand_off(engine, prompt, params)
    assert firsts == [lone[i][0] for i in range(3)]
    first = engine.add_prefilled(Prefilled("decoded", prompt, params, blocks, FirstTokens(firsts), rope_delta))
    assert [(o.request_id, o.index, o.token_ids) for o in first] == [("decoded", i, [firsts[i]]) for i in range(3)]
    assert all(s.preemption is Preemption.SWAP for s in engine.scheduler.sequences("decoded"))
    assert_own_copies(engine, "decoded")
    tokens = by_index(drain(engine, first), "decoded", 3)
    for i in range(3):
        same(tokens[i], lone[i])
    assert engine.allocator.num_used == 0


def test_add_prefilled_wants_one_first_token_per_sequence(engine, prompt):
    params = greedy(4, n=2)
    blocks = engine.reserve_blocks(prompt, params)
    with pytest.raises(ValueError, match="1 first tokens for 2 sequences"):
        engine.add_prefilled(Prefilled("one-token", prompt, params, blocks, FirstTokens([7])))
    assert engine.allocator.num_used == 0 and not engine.has_work()
    blocks = engine.reserve_blocks(prompt, params)
    with pytest.raises(ValueError, match="1 first-token logprobs for 2 sequences"):
        engine.add_prefilled(Prefilled("one-logprob", prompt, params, blocks, FirstTokens([7, 8], [None])))
    assert engine.allocator.num_used == 0 and not engine.has_work()


def test_a_fork_that_finds_no_free_block_waits_and_ends_with_the_right_tokens(engine, prompt, lone):
    """Colocated: the pool runs dry between the prompt's admission and its end (chunked prefill):
    the forks are parked for a recompute and readmitted once blocks are free."""
    engine.free_blocks(engine.allocator.allocate(engine.allocator.num_free))  # empties the prefix cache
    engine.scheduler.max_batched_tokens = engine.allocator.block_size  # the prompt takes a few steps
    try:
        engine.add_request("parked", prompt, seeded(24, n=3))
        assert engine.step() == []  # the first chunk
        hog = engine.allocator.allocate(engine.allocator.num_free)
        outputs = engine.step()
        while not outputs:
            outputs = engine.step()  # the last chunk: the n first tokens
        parked = [s for s in engine.scheduler.sequences("parked") if s.index]
        assert sorted(o.index for o in outputs) == [0, 1, 2] and len(parked) == 2
        assert all(s.num_preemptions == 1 and not s.blocks and s.recompute_outputs == 1 for s in parked)
        for _ in range(3):
            outputs += engine.step()  # sequence 0 goes on; the parked ones wait
        engine.free_blocks(hog)
        tokens = by_index(drain(engine, outputs), "parked", 3)
    finally:
        engine.scheduler.max_batched_tokens = engine.config.batched_tokens
    for i in range(3):
        same(tokens[i], lone[i])
    assert engine.allocator.num_used == 0


def test_a_decode_fork_that_finds_no_free_block_is_swapped_in_later(engine, prompt, lone):
    params = seeded(24, n=3)
    blocks, firsts, rope_delta = hand_off(engine, prompt, params)
    hog = engine.allocator.allocate(engine.allocator.num_free)
    first = engine.add_prefilled(Prefilled("parked-decode", prompt, params, blocks, FirstTokens(firsts), rope_delta))
    parked = [s for s in engine.scheduler.sequences("parked-decode") if s.index]
    assert len(parked) == 2 and all(s.swapped and not s.blocks for s in parked)
    outputs = first + [o for _ in range(3) for o in engine.step()]
    engine.free_blocks(hog)
    tokens = by_index(drain(engine, outputs), "parked-decode", 3)
    for i in range(3):
        same(tokens[i], lone[i])
    assert engine.allocator.num_used == 0


@pytest.mark.parametrize("decode", [False, True], ids=["recompute", "swap"])
def test_a_preempted_fork_keeps_its_tokens(engine, prompt, lone, decode):
    """A pool left with room for the prompt and the forks' first blocks but not for three sequences
    at their longest: the latest admitted sequences are preempted on the way, then readmitted."""
    params = seeded(24, n=3)
    block_size = engine.allocator.block_size
    longest = blocks_for_tokens(len(prompt.token_ids) + 24, block_size)
    full = len(prompt.token_ids) // block_size
    room = full + 2 * (longest - full)  # two sequences at their longest, not three
    if decode:
        blocks, firsts, rope_delta = hand_off(engine, prompt, params)
        hog = engine.allocator.allocate(engine.allocator.num_free - (room - len(blocks)))
        outputs = engine.add_prefilled(Prefilled("preempted", prompt, params, blocks, FirstTokens(firsts), rope_delta))
    else:
        hog = engine.allocator.allocate(engine.allocator.num_free - room)
        engine.add_request("preempted", prompt, params)
        outputs = []
    before = dict(engine.scheduler.preemptions)
    sequences = []
    for _ in range(MAX_STEPS):
        sequences += [s for s in engine.scheduler.sequences("preempted") if s not in sequences]
        if not engine.has_work():
            break
        outputs += engine.step()
    kind = "swap" if decode else "recompute"
    engine.free_blocks(hog)
    assert engine.scheduler.preemptions[kind] > before[kind]
    assert any(s.index and s.num_preemptions for s in sequences)
    tokens = by_index(drain(engine, outputs), "preempted", 3)
    for i in range(3):
        same(tokens[i], lone[i])
    assert engine.allocator.num_used == 0


@pytest.mark.unit
def test_n_sequences_that_cannot_all_fit_at_once_are_refused():
    """64 blocks of 16; a 37-token prompt (2 full blocks) and 300 tokens: 21 blocks at the longest."""
    scheduler = Scheduler(BlockAllocator(64, 16), max_num_seqs=8, max_batched_tokens=256)

    def request(n: int, hand_off: bool = False) -> Request:
        return Request("r", Prompt(token_ids=[5] * 37), greedy(300, n), hand_off=hand_off)

    assert [scheduler.group_blocks(request(n)) for n in (1, 3, 4)] == [21, 2 + 3 * 19, 2 + 4 * 19]
    scheduler.check_fits(request(3))
    with pytest.raises(ValueError, match=r"request needs 78 KV blocks \(prompt 37 \+ max_tokens 300, 4 sequences\) "
                                         r"but the pool has 64; lower max_tokens or n or start"):
        scheduler.check_fits(request(4))
    scheduler.check_fits(request(8, hand_off=True))  # a prefill's forks hold no blocks
    assert scheduler.fork_blocks(request(4)) == 3  # each fork's own copy of the partial last block


async def test_generate_streams_all_n_and_closing_it_aborts_all_n(engine, prompt, lone):
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        outputs = [o async for o in async_engine.generate("streamed", prompt, seeded(24, n=3))]
        tokens = by_index(outputs, "streamed", 3)
        for i in range(3):
            same(tokens[i], lone[i])
        stream = async_engine.generate("closed", prompt, seeded(200, n=3))
        seen = [await anext(stream) for _ in range(4)]
        assert {o.index for o in seen} == {0, 1, 2}
        await stream.aclose()
        for _ in range(100):
            if (await async_engine.call(lambda e: (e.has_work(), e.allocator.num_used))) == (False, 0):
                break
        assert await async_engine.call(lambda e: (e.has_work(), e.allocator.num_used)) == (False, 0)
    finally:
        async_engine.shutdown()


def test_reserving_gives_each_fork_every_block_past_the_shared_ones(prompt):
    engine, _ = load_engine(EngineConfig(model=str(model_dir("qwen2_vl")), kv_cache_mib=16, device=DEVICE,
                                         kv_allocation="reserve"), pixels=True)
    alone = run(engine, "alone", prompt, seeded(24))[0]
    engine.add_request("reserved", prompt, seeded(24, n=3))
    outputs = engine.step()
    sequences = engine.scheduler.sequences("reserved")
    longest = engine.scheduler.most_blocks(sequences[0])
    full = len(prompt.token_ids) // engine.allocator.block_size
    assert [len(s.blocks) for s in sequences] == [longest] * 3
    assert engine.allocator.num_used == longest + 2 * (longest - full)
    assert_own_copies(engine, "reserved")
    tokens = by_index(drain(engine, outputs), "reserved", 3)
    same(tokens[0], alone)
    assert engine.allocator.num_used == 0


def test_every_sequence_has_its_tokens_logprobs_and_only_sequence_0_the_prompts(engine, prompt):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=SEED, ignore_eos=True, n=3, logprobs=2,
                            prompt_logprobs=1)
    engine.add_request("logprobs", prompt, params)
    colocated = drain(engine)
    engine.add_request("prefill", prompt, params, hand_off=True)
    handed = sorted(drain(engine), key=lambda o: o.index)
    assert [o.logprobs for o in handed] == [o.logprobs for o in sorted(colocated, key=lambda o: o.index)
                                            if o.completion_tokens == 1]
    local = handed[0].blocks
    assert local is not None
    blocks = engine.reserve_blocks(prompt, params)
    engine.pool.tensor[blocks[: len(local)]] = engine.pool.tensor[local]
    engine.free_blocks(local)
    first = FirstTokens([o.token_ids[0] for o in handed], [o.logprobs[0] if o.logprobs else None for o in handed],
                        handed[0].prompt_logprobs)
    decoded = drain(engine, engine.add_prefilled(Prefilled("decoded", prompt, params, blocks, first,
                                                           handed[0].rope_delta)))
    for outputs in (colocated, handed, decoded):
        with_prompt = [o for o in outputs if o.prompt_logprobs is not None]
        assert [(o.index, o.completion_tokens) for o in with_prompt] == [(0, 1)]
        assert len(with_prompt[0].prompt_logprobs) == len(prompt.token_ids)
        for output in outputs:
            assert output.logprobs is not None
            assert [lp.token_id for lp in output.logprobs] == output.token_ids
    assert by_index(decoded, "decoded", 3) == by_index(colocated, "logprobs", 3)
    assert engine.allocator.num_used == 0


@pytest.mark.unit
def test_the_scheduler_forks_with_shared_blocks_or_parks_and_admits_with_room_for_the_forks():
    """Pure logic: 16 blocks of 16 (watermark 1), a 37-token prompt (2 full blocks and a partial one)."""
    allocator = BlockAllocator(16, 16)
    scheduler = Scheduler(allocator, max_num_seqs=8, max_batched_tokens=256)
    parent = Request("r", Prompt(token_ids=[5] * 37), greedy(8, n=3))
    hog = allocator.allocate(16 - 4)  # the prompt's 3 blocks and 1 more: not room for 2 forks' copies
    scheduler.add(parent)
    assert not scheduler.schedule()  # waits: admission leaves room for the forks
    allocator.free(hog[:1])
    assert scheduler.schedule().prefills == [parent]
    parent.num_computed, parent.output_ids = 37, [1]
    forks = [parent.fork(i) for i in (1, 2)]
    for fork in forks:
        fork.output_ids.append(2)
    assert [scheduler.fork(parent, fork) for fork in forks] == [True, True]
    assert [f.blocks[:2] for f in forks] == [parent.blocks[:2]] * 2 and [len(f.blocks) for f in forks] == [3, 3]
    assert allocator.num_used == 11 + 3 + 2 and allocator.num_free == 0
    late = parent.fork(3)
    late.output_ids.append(3)
    assert scheduler.fork(parent, late) is False  # no block for its copy: parked for a recompute
    assert scheduler.waiting[0] is late and late.num_computed == 0 and late.recompute_outputs == 1
    assert (late.request_id, late.group_id, late.index) == ("r#3", "r", 3)
    assert scheduler.sequences("r") == [late, parent, *forks]
