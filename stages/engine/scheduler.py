"""Continuous batching under a token budget. Pure logic: no torch, no I/O.

Each ``schedule()`` call builds one batch for one forward pass:

1. every running request decodes one token (up to ``max_num_seqs`` requests);
2. waiting requests are admitted first-come first-served while their prompt fits in what is left
   of ``max_batched_tokens`` and the allocator can reserve their blocks. The first prompt of a step
   is admitted even when it is larger than what is left of the budget, so a long prompt cannot starve.

**When blocks run out** a request is not admitted: it waits, in order, until running requests
finish and free theirs. Blocks are reserved for the whole request (prompt plus ``max_tokens``) on
admission, so a running request never needs a block it cannot get: no preemption, no recompute,
no deadlock. A request that could never fit in the pool is refused by ``add`` with an error. The
price is memory held for tokens that may never be generated; the server bounds ``max_tokens`` by the
context length, and the pool is sized for ``max_num_seqs`` long requests by default.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from stages.engine.block_allocator import BlockAllocator, blocks_for_tokens
from stages.engine.request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledBatch:
    prefills: list[Request] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)

    @property
    def requests(self) -> list[Request]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(r.prompt_len - r.num_computed for r in self.prefills) + len(self.decodes)


class Scheduler:
    """Owns the waiting queue and the running set of one engine. Called from the engine thread only."""

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_batched_tokens: int) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

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
        batch = ScheduledBatch(decodes=self.running[: self.max_num_seqs])
        budget = self.max_batched_tokens - len(batch.decodes)
        while self.waiting and len(batch.decodes) + len(batch.prefills) < self.max_num_seqs:
            request = self.waiting[0]
            tokens = request.prompt_len
            if (tokens > budget and batch.prefills) or not self.allocator.can_allocate(self.blocks_needed(request)):
                break
            self.waiting.popleft()
            request.blocks = self.allocator.allocate(self.blocks_needed(request))
            request.advance(RequestStatus.RUNNING)
            batch.prefills.append(request)
            budget -= tokens
        return batch

    def after_step(self, batch: ScheduledBatch) -> None:
        """Move freshly prefilled requests into the running set, drop finished ones, free their blocks."""
        for request in batch.prefills:
            if request.status is RequestStatus.RUNNING:
                self.running.append(request)
            else:  # finished in its prefill step
                self._release(request)
        self.reap()

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
