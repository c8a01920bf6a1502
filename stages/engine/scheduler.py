"""Continuous batching under a token budget, with chunked prefill. Pure logic: no torch, no I/O.

Each ``schedule()`` call builds one batch for one forward pass, holding at most
``max_batched_tokens`` tokens (a decode counts one):

1. every running request whose prompt is computed decodes one token (up to ``max_num_seqs``);
2. running requests still in chunked prefill take the next chunk of their prompt, in admission
   order, as much as what is left of the budget allows;
3. waiting requests are admitted first-come first-served while budget is left and the allocator can
   reserve their blocks; a prompt longer than what is left is cut, and the rest follows in later
   steps (between which the decodes keep going). A prefill's ``num_scheduled`` is its chunk.

If the decodes alone fill the budget no prefill runs that step; decodes end (``max_tokens``), so
prompts wait a bounded time.

**When blocks run out** a request is not admitted: it waits, in order, until running requests
finish and free theirs. Blocks are reserved for the whole request (prompt plus ``max_tokens``) on
admission, so a running request (in chunked prefill or decoding) never needs a block it cannot get:
no preemption, no recompute, no deadlock. A request that could never fit in the pool is refused by
``add`` with an error. The price is memory held for tokens that may never be generated; the server
bounds ``max_tokens`` by the context length, and the pool is sized for ``max_num_seqs`` long
requests by default.

**Prefix caching** (a request with ``block_hashes``): admission looks up the longest chain of its
prompt's full blocks in the allocator's index (``cached_prefix``), capped so that at least the last
prompt token is computed (the step must yield logits; so a request never writes into a shared
block), takes a reference to those blocks (``share``), allocates the rest and starts the request
at ``num_computed`` = the hit. After each step the blocks a prefill chunk completed are registered
(``register``), so later requests hit them, even while this one still runs. Release is the same
``free`` for shared and own blocks: it drops this request's references.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from stages.engine.block_allocator import BlockAllocator, blocks_for_tokens
from stages.engine.request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledBatch:
    """One step's work: prefill chunks (``chunks[i]`` prompt tokens of ``prefills[i]``), then decodes."""

    prefills: list[Request] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)

    @property
    def requests(self) -> list[Request]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(self.chunks) + len(self.decodes)


class Scheduler:
    """Owns the waiting queue and the running set of one engine. Called from the engine thread only."""

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_batched_tokens: int) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix_queries = 0  # prompt tokens of admitted requests looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, tokens whose KV was found there

    def blocks_needed(self, request: Request) -> int:
        """Prompt plus every output token but the last; a hand-off (prefill-only) request needs the prompt only."""
        tokens = request.prompt_len if request.hand_off else request.max_total_tokens
        return blocks_for_tokens(tokens, self.allocator.block_size)

    def check_fits(self, request: Request) -> None:
        """Raise ValueError if the request could never be admitted, however long it waited."""
        need = self.blocks_needed(request)
        if need > self.allocator.num_blocks:
            raise ValueError(
                f"request needs {need} KV blocks (prompt {request.prompt_len} + max_tokens "
                f"{request.params.max_tokens}) but the pool has {self.allocator.num_blocks}; "
                "lower max_tokens or start the server with a larger --kv-cache-mib"
            )

    def add(self, request: Request) -> None:
        """Queue a request that needs prefill."""
        self.check_fits(request)
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Add a request whose prompt KV is already in its (caller-allocated) blocks, e.g. written by a
        prefill server. It decodes from the next step on."""
        request.advance(RequestStatus.RUNNING)
        self.running.append(request)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(decodes=[r for r in self.running if r.prompt_done][: self.max_num_seqs])
        budget = self.max_batched_tokens - len(batch.decodes)
        for request in [r for r in self.running if not r.prompt_done]:  # chunked prefills in progress
            if budget <= 0 or self._full(batch):
                break
            budget -= self._add_chunk(batch, request, budget)
        while self.waiting and budget > 0 and not self._full(batch):
            request = self.waiting[0]
            cached = self.cached_blocks(request)
            if not self.allocator.can_allocate(self.blocks_needed(request) - len(cached), shared=cached):
                break
            self.waiting.popleft()
            self._admit(request, cached)
            budget -= self._add_chunk(batch, request, budget)
        return batch

    def cached_blocks(self, request: Request) -> list[int]:
        """The cached blocks a request would start from now: its longest cached chain, within
        ``prompt_len - 1`` tokens. No side effects."""
        if request.block_hashes is None:
            return []
        usable = (request.prompt_len - 1) // self.allocator.block_size
        return self.allocator.cached_prefix(request.block_hashes[:usable])

    def _admit(self, request: Request, cached: list[int]) -> None:
        """Hold the request's blocks (the cached chain shared, the rest allocated) and start it past the hit."""
        self._hold(request, cached)
        request.num_computed = request.num_cached_tokens
        request.advance(RequestStatus.RUNNING)
        self.running.append(request)

    def reserve(self, request: Request) -> int:
        """Hold every block a request whose prompt KV will be written from elsewhere needs (a decode
        server's), its longest cached chain shared; returns how many leading blocks are those (their KV
        is here already). MemoryError, holding nothing, if the pool cannot give the rest now."""
        cached = self.cached_blocks(request)
        need = self.blocks_needed(request) - len(cached)
        if not self.allocator.can_allocate(need, shared=cached):
            raise MemoryError(f"asked for {need} KV blocks, {self.allocator.num_free} free of "
                              f"{self.allocator.num_blocks}")
        self._hold(request, cached)
        return len(cached)

    def _hold(self, request: Request, cached: list[int]) -> None:
        shared = self.allocator.share(cached)  # first: so that allocate cannot evict them
        request.blocks = shared + self.allocator.allocate(self.blocks_needed(request) - len(cached))
        request.num_cached_tokens = len(cached) * self.allocator.block_size
        request.num_registered = len(cached)
        if request.block_hashes is not None:
            self.prefix_queries += request.prompt_len
            self.prefix_hit_tokens += request.num_cached_tokens

    def _full(self, batch: ScheduledBatch) -> bool:
        return len(batch.decodes) + len(batch.prefills) >= self.max_num_seqs

    @staticmethod
    def _add_chunk(batch: ScheduledBatch, request: Request, budget: int) -> int:
        """Schedule the next chunk (at most ``budget`` tokens) of ``request``'s prompt; returns its size."""
        request.num_scheduled = min(request.prompt_len - request.num_computed, budget)
        batch.prefills.append(request)
        batch.chunks.append(request.num_scheduled)
        return request.num_scheduled

    def after_step(self, batch: ScheduledBatch) -> None:
        """Register the prompt blocks this step's chunks completed, then drop the requests that
        finished in this step (in a prefill or a decode) and free their blocks. Requests still in
        chunked prefill stay running and get their next chunk next step."""
        for request in batch.prefills:
            self.register(request)
        self.reap()

    def register(self, request: Request) -> None:
        """Put the request's full prompt blocks whose KV is now in the pool into the prefix cache's index."""
        if request.block_hashes is None:
            return
        full = min(request.num_computed // self.allocator.block_size, len(request.block_hashes))
        for index in range(request.num_registered, full):
            self.allocator.register(request.blocks[index], request.block_hashes[index])
        request.num_registered = max(request.num_registered, full)

    def reap(self) -> None:
        """Drop finished requests from the running set and release their blocks."""
        for request in [r for r in self.running if r.status is RequestStatus.FINISHED]:
            self.running.remove(request)
            self._release(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request wherever it is; its blocks are freed now. Returns it, or None if unknown."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    request.finish(FinishReason.ABORT)
                    self._release(request)
                    return request
        return None

    def _release(self, request: Request) -> None:
        if request.hand_off and request.finish_reason is not FinishReason.ABORT:
            return  # the blocks now belong to whoever moves the KV (Engine.free_blocks)
        if request.blocks:
            self.allocator.free(request.blocks)
            request.blocks = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
