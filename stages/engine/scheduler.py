"""Continuous batching under a token budget, with chunked prefill and preemption. Pure logic: no
torch, no I/O.

Each ``schedule()`` call builds one batch for one forward pass, holding at most
``max_batched_tokens`` tokens (a decode counts one):

1. every running request whose prefill is computed gets the slot of its next token (``_ensure_slots``,
   below) and decodes one token (up to ``max_num_seqs``);
2. running requests still in chunked prefill take their next chunk, in admission order, as much as
   what is left of the budget allows;
3. waiting requests are admitted first-come first-served (preempted ones first, at the front) while
   budget is left and their blocks can be taken (``_admit``); a prefill longer than what is left is
   cut, and the rest follows in later steps. A prefill's ``num_scheduled`` is its chunk.

If the decodes alone fill the budget no prefill runs that step; decodes end (``max_tokens``), so
prompts wait a bounded time.

**KV on demand** (``kv_allocation="on_demand"``, the default): admission takes the blocks of the
prefill only (the prompt; after a recompute preemption the prompt and the outputs; a swapped-in
request the blocks of its KV and its next slot), and only while ``watermark`` blocks stay free (or
nothing is running), so running requests have room to grow. Before each step every decode must own
its next token's slot; when the pool runs dry the most recently admitted running request is
preempted (``_preempt``: its blocks freed, back to the front of the waiting queue, tokens kept), then
the next most recent, until the rest fit; the oldest always fits, since ``check_fits`` refused at
``add`` whatever could not run alone. What a preemption does with the KV is the request's
``preemption``: ``recompute`` (its next prefill covers prompt + outputs) or ``swap`` (the batch's
``swap_out`` names its blocks for the engine to copy to the host before the pass, ``swap_in`` the
blocks it copies them back into). A step that preempts admits nobody. Hand-off requests (a prefill
server's) never grow past the prompt and are never preempted.

**Reservation** (``kv_allocation="reserve"``, the benchmark's baseline): admission takes the blocks of
prompt + ``max_tokens`` at once, so nothing ever grows or is preempted; the price is memory held for
tokens that may never be generated.

**Prefix caching** (a request with ``block_hashes``): admission looks up the longest chain of its
prompt's full blocks in the allocator's index (``cached_prefix``), capped so that at least the last
prompt token is computed (the step must yield logits; so a request never writes into a shared
block; a request still to give prompt logprobs takes no hit: it needs every position's logits), takes a reference to those blocks (``share``), allocates the rest and starts the request
at ``num_computed`` = the hit; a recompute's readmission looks its prompt up again (its outputs are
never cached), a swapped request's does not. After each step the blocks a prefill chunk completed
are registered (``register``), so later requests hit them, even while this one still runs. Release
(finish, abort, preemption) is the same ``free`` for shared and own blocks: it drops this request's
references, and what it registered stays cached.

**Inputs still coming** (an EPD prefill's ``Request.pending``: images whose embeddings are being read
or encoded): no chunk reaches the first placeholder of the first such image the request still needs
(``ready_len``; one wholly inside its prefix hit is not needed), so the text before it, and each
image's span once its embedding is given (``Engine.provide``), is computed while the rest is on its
way. A request with nothing to compute is left out of the batch and does not count as work
(``has_work``): the engine thread sleeps until a command (the embedding) wakes it.

**n sequences** (``params.n``; see ``request.py``): a request is admitted as its sequence 0, which
computes the prompt; when that is done, the engine forks the others (``fork``): each shares the
prompt's full blocks (a reference more, ``BlockAllocator.retain``) and takes ``own_blocks`` of its
own (on demand, its copy of the last, partial prompt block; reserving, every block past the shared
ones), then runs like any request. A fork the pool cannot give those blocks to waits at the front of
the queue as if preempted at once (recompute, or swap with its KV on the host). Admission leaves
room for the forks' blocks (``fork_blocks``); ``check_fits`` refuses a request whose n sequences
could not all be held at their longest at once (``group_blocks``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from stages.engine.block_allocator import BlockAllocator, blocks_for_tokens
from stages.engine.config import KV_ALLOCATIONS
from stages.engine.request import FinishReason, Preemption, Request, RequestStatus

WATERMARK_FRACTION = 0.01  # of the pool kept free at admission for running requests to grow into (vLLM's 1%)


@dataclass
class ScheduledBatch:
    """One step's work: prefill chunks (``chunks[i]`` tokens of ``prefills[i]``), then decodes; the KV
    the engine copies before the pass: ``swap_out`` (the blocks of requests preempted to the host, freed
    already, copied out first) and ``swap_in`` (the blocks of swapped requests readmitted, to fill)."""

    prefills: list[Request] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out: list[tuple[Request, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[Request, list[int]]] = field(default_factory=list)

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

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_batched_tokens: int,
                 kv_allocation: str = "on_demand", watermark: int | None = None) -> None:
        """``watermark``: blocks admission leaves free (None: 1% of the pool, at least 1; 0 when reserving)."""
        if kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(f"--kv-allocation must be one of {KV_ALLOCATIONS}, got {kv_allocation!r}")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.on_demand = kv_allocation == "on_demand"
        if watermark is None:
            watermark = max(1, int(allocator.num_blocks * WATERMARK_FRACTION)) if self.on_demand else 0
        self.watermark = watermark
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix_queries = 0  # prompt tokens of admitted requests looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, tokens whose KV was found there
        self.preemptions = {kind.value: 0 for kind in Preemption}

    def _blocks(self, tokens: int) -> int:
        return blocks_for_tokens(tokens, self.allocator.block_size)

    def most_blocks(self, request: Request) -> int:
        """Blocks the request holds at its longest: prompt plus every output token but the last; a
        hand-off (prefill-only) request's prompt."""
        return self._blocks(request.prompt_len if request.hand_off else request.max_total_tokens)

    def own_blocks(self, request: Request) -> int:
        """Blocks a forked sequence of ``request`` takes besides the prompt's full blocks it shares (see
        the module docstring); none for a hand-off request, whose forks hold no KV."""
        if request.hand_off:
            return 0
        longest = self.most_blocks(request) if not self.on_demand else self._blocks(request.prompt_len)
        return longest - request.prompt_len // self.allocator.block_size

    def fork_blocks(self, request: Request) -> int:
        """Blocks the forks of ``request`` take when its prompt is done: ``own_blocks`` for each of its
        other ``n - 1`` sequences while it is a sequence 0 that has not forked yet (no output), else 0."""
        if request.index or request.output_ids:
            return 0
        return (request.params.n - 1) * self.own_blocks(request)

    def group_blocks(self, request: Request) -> int:
        """Blocks the request's ``n`` sequences hold at their longest, all at once: the prompt's full
        blocks once, and each sequence's blocks past them."""
        if request.hand_off:
            return self.most_blocks(request)
        shared = request.prompt_len // self.allocator.block_size
        return shared + request.params.n * (self.most_blocks(request) - shared)

    def blocks_needed(self, request: Request) -> int:
        """Blocks admission takes: reserving, ``most_blocks``; on demand, the prefill's (a swapped
        request's: its KV's and its next slot's)."""
        if not self.on_demand:
            return self.most_blocks(request)
        return self._blocks(request.num_computed + 1 if request.swapped else request.prefill_len)

    def can_admit(self, num_blocks: int, shared: list[int] | tuple[()] = ()) -> bool:
        """Whether ``num_blocks`` can be taken now, after sharing the cached blocks ``shared``, leaving
        the watermark free (or with nothing running). No side effects."""
        return self.allocator.can_allocate(num_blocks + (self.watermark if self.running else 0), shared=shared)

    @property
    def preempted_waiting(self) -> bool:
        """A preempted request waits at the front: it is readmitted before anything new."""
        return bool(self.waiting) and self.waiting[0].num_preemptions > 0

    def check_fits(self, request: Request) -> None:
        """Raise ValueError if the request (its n sequences at their longest at once) could never be
        admitted, however long it waited."""
        need = self.group_blocks(request)
        if need > self.allocator.num_blocks:
            sequences = f", {request.params.n} sequences" if request.params.n > 1 and not request.hand_off else ""
            raise ValueError(
                f"request needs {need} KV blocks (prompt {request.prompt_len} + max_tokens "
                f"{request.params.max_tokens}{sequences}) but the pool has {self.allocator.num_blocks}; "
                "lower max_tokens" + (" or n" if sequences else "") + " or start the server with a larger --kv-cache-mib"
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
        batch = ScheduledBatch()
        self._ensure_slots(batch)
        batch.decodes = self._decoding()
        budget = self.max_batched_tokens - len(batch.decodes)
        for request in [r for r in self.running if not r.prompt_done]:  # chunked prefills in progress
            if budget <= 0 or self._full(batch):
                break
            budget -= self._add_chunk(batch, request, budget)
        while self.waiting and budget > 0 and not self._full(batch) and not batch.preempted:
            used = self._admit(batch, self.waiting[0], budget)
            if used is None:
                break
            budget -= used
        return batch

    def cached_blocks(self, request: Request) -> list[int]:
        """The cached blocks a request would start from now: its longest cached chain, within
        ``prompt_len - 1`` tokens. No side effects."""
        if request.block_hashes is None:
            return []
        usable = (request.prompt_len - 1) // self.allocator.block_size
        return self.allocator.cached_prefix(request.block_hashes[:usable])

    def _decoding(self) -> list[Request]:
        return [r for r in self.running if r.prompt_done][: self.max_num_seqs]

    def _ensure_slots(self, batch: ScheduledBatch) -> None:
        """Give each decode of this step the block of its next token's slot, oldest first; when blocks
        are short, preempt the most recently admitted running request, again, until it fits."""
        served = 0
        for request in [r for r in self.running if r.prompt_done]:
            if served == self.max_num_seqs:
                break
            if request not in self.running:  # preempted for an older one's slot
                continue
            need = self._blocks(request.num_computed + 1) - len(request.blocks)
            while need > self.allocator.num_free:
                victim = next(r for r in reversed(self.running) if not r.hand_off)  # ``request`` at the latest
                self._preempt(batch, victim)
                if victim is request:
                    break
            else:
                request.blocks += self.allocator.allocate(max(need, 0))
                served += 1

    def _preempt(self, batch: ScheduledBatch, request: Request) -> None:
        """Free ``request``'s blocks and send it to the front of the waiting queue (``Request.preempt``)."""
        self.running.remove(request)
        if request.preemption is Preemption.SWAP:
            batch.swap_out.append((request, request.blocks[: self._blocks(request.num_computed)]))
        self.allocator.free(request.blocks)
        request.blocks = []
        request.preempt()
        self.waiting.appendleft(request)
        batch.preempted.append(request)
        self.preemptions[request.preemption.value] += 1

    def _admit(self, batch: ScheduledBatch, request: Request, budget: int) -> int | None:
        """Admit the first waiting request if its blocks can be taken: a swapped one decodes at once
        (its KV copied back in), any other starts its prefill past its cached prefix. Returns the
        tokens it adds to the step, None if it must wait."""
        # a request still to give its prompt logprobs computes its whole prompt (vLLM's rule: no hit)
        whole = request.params.prompt_logprobs is not None and not request.output_ids
        cached = [] if request.swapped or whole else self.cached_blocks(request)
        if not self.can_admit(self.blocks_needed(request) + self.fork_blocks(request) - len(cached), cached):
            return None
        self.waiting.popleft()
        self._hold(request, cached)
        request.advance(RequestStatus.RUNNING)
        self.running.append(request)
        if request.swapped:
            request.swapped = False
            batch.swap_in.append((request, request.blocks[: self._blocks(request.num_computed)]))
            batch.decodes.append(request)
            return 1
        request.num_computed = len(cached) * self.allocator.block_size
        return self._add_chunk(batch, request, budget)

    def reserve(self, request: Request) -> int:
        """Hold the blocks a request whose prompt KV will be written from elsewhere needs on admission
        (a decode server's: its prompt's, on demand), its longest cached chain shared; returns how many
        leading blocks are those (their KV is here already). MemoryError, holding nothing, if the pool
        cannot give the rest now (the watermark kept free, preempted requests readmitted first)."""
        cached = self.cached_blocks(request)
        need = self.blocks_needed(request) + self.fork_blocks(request) - len(cached)
        if self.preempted_waiting or not self.can_admit(need, cached):
            raise MemoryError(f"asked for {need} KV blocks, {self.allocator.num_free} free of "
                              f"{self.allocator.num_blocks} (keeping {self.watermark} free"
                              + (", preempted requests first)" if self.preempted_waiting else ")"))
        self._hold(request, cached)
        return len(cached)

    def fork(self, parent: Request, child: Request) -> bool:
        """Run ``child`` (``parent.fork(i)``, its first token appended; the prompt's KV all in ``parent``'s
        blocks) beside its parent: the parent's full prompt blocks shared, ``own_blocks`` of its own,
        the first of which the engine fills with its copy of the parent's last, partial prompt block
        (if any). Returns False, having parked it, if the pool cannot give those blocks: it waits at the
        front of the queue as if preempted at once (``Request.preempt``; a swap's KV, the prompt's,
        is for the engine to copy to the host)."""
        child.num_computed = parent.prompt_len
        child.advance(RequestStatus.RUNNING)
        own = self.own_blocks(child)
        if not self.allocator.can_allocate(own):
            child.preempt()
            self.waiting.appendleft(child)
            self.preemptions[child.preemption.value] += 1
            return False
        shared = self.allocator.retain(parent.blocks[: parent.prompt_len // self.allocator.block_size])
        child.blocks = shared + self.allocator.allocate(own)
        self.running.append(child)
        return True

    def _hold(self, request: Request, cached: list[int]) -> None:
        """Give the request its admission blocks: the cached chain shared, the rest allocated. A
        readmission looks the prompt up again, but its usage keeps its first admission's hit."""
        shared = self.allocator.share(cached)  # first: so that allocate cannot evict them
        request.blocks = shared + self.allocator.allocate(self.blocks_needed(request) - len(cached))
        hit = len(cached) * self.allocator.block_size
        request.num_registered = len(cached)
        if not request.num_preemptions:
            request.num_cached_tokens = hit
        if request.block_hashes is not None and not request.swapped:
            self.prefix_queries += request.prompt_len
            self.prefix_hit_tokens += hit

    def _full(self, batch: ScheduledBatch) -> bool:
        return len(batch.decodes) + len(batch.prefills) >= self.max_num_seqs

    @staticmethod
    def _add_chunk(batch: ScheduledBatch, request: Request, budget: int) -> int:
        """Schedule the next chunk (at most ``budget`` tokens, none past ``ready_len``) of ``request``'s
        prefill; returns its size (0: it waits for an image's embedding, and is not in this batch)."""
        request.num_scheduled = max(0, min(request.ready_len - request.num_computed, budget))
        if not request.num_scheduled:
            return 0
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

    def sequences(self, group_id: str) -> list[Request]:
        """The live sequences (waiting or running) of the request ``group_id``."""
        return [r for queue in (self.waiting, self.running) for r in queue if r.group_id == group_id]

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
        """A step would do something: a request waits for admission, or a running one can compute (not
        every one waits for an image's embedding: those are woken by ``Engine.provide``)."""
        return bool(self.waiting) or any(not r.waits_for_inputs for r in self.running)
