"""One generation request inside an engine: its prompt, its KV blocks, its output so far.

A request's ``status`` moves forward, WAITING -> RUNNING -> FINISHED, with one way back: a
preemption (``preempt``) sends a RUNNING request to WAITING, as nano-vllm does; it keeps its output
tokens and is admitted again later. The scheduler moves it; the engine appends tokens. Its blocks
are the scheduler's (see ``scheduler.py`` for when they are taken) and are freed exactly once per
admission: when it finishes, is aborted or is preempted.

A RUNNING request whose prefill is not all computed yet (``prompt_done`` False) is in chunked
prefill: each step the scheduler sets ``num_scheduled`` (the tokens that step computes), the runner
computes ``[num_computed, chunk_end)`` and moves ``num_computed`` to ``chunk_end``. Only the step
that completes the prefill yields a token. The prefill is the prompt, or, for a request preempted
with ``recompute``, the prompt and every output token so far (``prefill_len``): the logits at its
last position give the next token, as the decode of the last output token would have.

Prefix caching: ``block_hashes`` (None when it is off) are the chain hashes of the prompt's full
blocks (``stages.engine.prefix_cache``). On admission the scheduler starts the request past the
longest cached chain (``num_cached_tokens`` = the first ``num_computed`` of its first admission:
those blocks are shared, not computed); as later chunks complete blocks they are registered for
others (``num_registered``). A recompute's readmission looks its prompt up again.

``n`` sequences (``params.n``): the client's request is ``n`` Requests that share its id
(``group_id``) and differ by ``index``; each has its own ``request_id`` in the engine
(``sequence_id``). Sequence 0 computes the prompt; at its end the others are forked from it
(``fork``) and run as requests of their own (scheduled, preempted and finished one by one).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stages.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from stages.engine.multimodal import Prompt


def sequence_id(request_id: str, index: int) -> str:
    """The engine's id of sequence ``index`` of request ``request_id``: the request's own id for
    sequence 0 (so a request with ``n == 1`` is known by its id), ``"<id>#<index>"`` for the others."""
    return request_id if index == 0 else f"{request_id}#{index}"


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Preemption(str, enum.Enum):
    """What a preemption does with a request's KV (chosen by how the request entered the engine)."""

    RECOMPUTE = "recompute"  # freed; prompt + outputs prefilled again on readmission
    SWAP = "swap"  # copied to host memory, copied back on readmission (a decode: no vision tower)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the client or by a failure elsewhere


@dataclass(eq=False)
class Request:
    request_id: str  # unique among the engine's live sequences (``sequence_id``)
    prompt: Prompt
    params: SamplingParams
    status: RequestStatus = RequestStatus.WAITING
    blocks: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the pool
    num_scheduled: int = 0  # prompt tokens this step's prefill chunk computes (set by the scheduler)
    rope_delta: int = 0  # M-RoPE: decode position = tokens so far + rope_delta
    finish_reason: FinishReason | None = None
    # Prefill-only (a prefill server's request): when it finishes normally its blocks are not freed
    # but handed to the caller, who moves the KV to a decode server and then frees them.
    hand_off: bool = False
    block_hashes: list[bytes] | None = None  # prefix caching: the prompt's full blocks' chain hashes
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (set on admission)
    num_registered: int = 0  # leading blocks already in the prefix cache's index
    preemption: Preemption = Preemption.RECOMPUTE
    recompute_outputs: int = 0  # output tokens the next prefill computes too (after a recompute preemption)
    swapped: bool = False  # WAITING with its KV on the host (a swap preemption), ``num_computed`` kept
    num_preemptions: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    index: int = 0  # which of the request's ``params.n`` sequences this is
    group_id: str = ""  # the client's request id, shared by its n sequences ("": ``request_id``)
    # an EPD prefill's images whose embeddings have not come yet (``Engine.provide``): image index ->
    # its placeholders' (first, end) positions; no chunk computes at or past the first of them it needs
    pending: dict[int, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens a prefill computes before the request decodes: the prompt, plus the output tokens of a
        recompute preemption."""
        return self.prompt_len + self.recompute_outputs

    @property
    def prefill_ids(self) -> list[int]:
        return self.prompt.token_ids + self.output_ids[: self.recompute_outputs]

    @property
    def prompt_done(self) -> bool:
        """Every prefill token's KV is in the pool: the request decodes from now on."""
        return self.num_computed >= self.prefill_len

    @property
    def ready_len(self) -> int:
        """Prefill tokens whose inputs are here: up to the first placeholder of the first pending image
        not wholly inside what is computed (a prefix hit may cover some), else the whole prefill."""
        return min((first for first, end in self.pending.values() if end > self.num_computed),
                   default=self.prefill_len)

    @property
    def waits_for_inputs(self) -> bool:
        """In prefill, with nothing to compute until an image's embedding comes."""
        return not self.prompt_done and self.ready_len <= self.num_computed

    @property
    def chunk_end(self) -> int:
        """Prompt tokens computed once this step's chunk is (``num_computed`` + ``num_scheduled``)."""
        return self.num_computed + self.num_scheduled

    @property
    def max_total_tokens(self) -> int:
        """Token slots this request may ever need: prompt plus every output token but the last."""
        return self.prompt_len + self.params.max_tokens - 1

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt.token_ids[-1]

    def advance(self, status: RequestStatus) -> None:
        if status < self.status:
            raise ValueError(f"request {self.request_id}: status may not move from {self.status.name} to {status.name}")
        self.status = status

    def preempt(self) -> None:
        """RUNNING -> WAITING, the one way back (the scheduler has taken its blocks): with ``recompute``
        its KV is dropped and its next prefill covers its outputs too; with ``swap`` it is on the host."""
        if self.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {self.request_id}: only a RUNNING request can be preempted, not {self.status.name}")
        if self.preemption is Preemption.RECOMPUTE:
            self.num_computed, self.recompute_outputs = 0, len(self.output_ids)
        else:
            self.swapped = True
        self.num_preemptions += 1
        self.status = RequestStatus.WAITING

    def fork(self, index: int) -> Request:
        """Sequence ``index`` of this request (sequence 0), at the end of its prompt: same prompt,
        parameters, prefix-cache hashes and hit, KV kind and M-RoPE offset; WAITING, no blocks, no
        output yet (the engine gives it its blocks or parks it, see ``Engine._fork``)."""
        return Request(sequence_id(self.group_id, index), self.prompt, self.params, hand_off=self.hand_off,
                       block_hashes=self.block_hashes, num_cached_tokens=self.num_cached_tokens,
                       preemption=self.preemption, rope_delta=self.rope_delta, arrival=self.arrival,
                       index=index, group_id=self.group_id)

    def finish(self, reason: FinishReason) -> None:
        self.finish_reason = self.finish_reason or reason
        self.advance(RequestStatus.FINISHED)
