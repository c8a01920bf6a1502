"""The synchronous engine: one model, one KV pool, one scheduler. Driven by one thread.

Requests come in through ``add_request`` (prompts to prefill; with ``hand_off``, a prefill server's
requests, which stop after the first token and hand their blocks over) and ``add_prefilled`` (a
decode server's requests, whose prompt KV was written into blocks from ``reserve_blocks`` or
``reserve_cached``). ``step()`` runs them: schedule, encode new images, one packed forward pass over
prefills and decodes together, sample, detokenize, finish. The servers call it in a loop (see
``AsyncEngine``).

Prefix caching (``EngineConfig.prefix_caching``): a prompt's full blocks are hashed on admission
(``prefix_cache.block_hashes``) and the scheduler starts it past its longest cached chain; a
decode's ``add_prefilled`` registers the prompt's blocks that arrived, and ``reserve_cached`` starts
a later reservation from them. ``free_blocks`` drops the caller's references (shared blocks stay
with their other holders, cached ones stay cached).

``n`` sequences (``params.n``, see ``request.py``): sequence 0 computes the prompt; the pass that
completes it draws the first tokens of all n from its row of logits (repeated, each sequence with
its own generator, seeded ``params.seed_of(i)``), and the other sequences are forked (``_fork``):
each shares the prompt's full blocks and gets its own copy of the last, partial one, or, when the
pool has no block for that copy, waits as if preempted at once (a colocated fork recomputes prompt
and first token, hitting the prefix cache if on; a decode's is swapped: the prompt's KV copied to
the host). A decode's ``add_prefilled`` forks the same way with the prefill's n first tokens. Every
output carries its sequence's ``index``; ``abort`` aborts all n.

Failure contract:

- admission is all-or-nothing: ``add_request``, ``add_prefilled`` and ``reserve_blocks`` / ``reserve_cached`` either
  succeed or raise leaving no trace (no scheduler entry, no per-request state, no blocks held);
- a request is never failed for want of KV blocks once admitted: the scheduler preempts (see
  ``scheduler.py``); the engine keeps the request's tokens, generator and detokenizer (``_tracked``)
  through it, and carries out swaps (``_swap``: a decode's request, which entered through
  ``add_prefilled``, has its KV copied to host memory, since a decode cannot recompute a prompt's
  images; any other is recomputed);
- one request's failure is its own: a request whose images cannot be encoded, whose own forward
  pass raises, or whose logits cannot be sampled with its parameters is finished with an error,
  and every other request of the step goes on with exactly the tokens it would have had alone.
  A step never fails the engine.

Not thread-safe: exactly one thread calls into an Engine (see ``AsyncEngine``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from stages.engine.attention import ATTENTION_NAME
from stages.engine.block_allocator import BlockAllocator, blocks_for_tokens
from stages.engine.config import EngineConfig
from stages.engine.detokenizer import TextDecoding
from stages.engine.kv_memory import memory_at_start, size_pool
from stages.engine.kv_pool import KVLayout, KVPool
from stages.engine.logprobs import TokenLogprob
from stages.engine.models import load_adapter
from stages.engine.image_encoding import encode_missing
from stages.engine.multimodal import ImageEmbedding, Prompt
from stages.engine.outputs import EngineStats, RequestOutput
from stages.engine.prefilled import FirstTokens, Prefilled
from stages.engine.prefix_cache import block_hashes, image_spans
from stages.engine.request import FinishReason, Preemption, Request, RequestStatus, sequence_id
from stages.engine.runner import ModelRunner
from stages.engine.sampler import make_generator
from stages.engine.sampling_params import SamplingParams
from stages.engine.scheduler import ScheduledBatch, Scheduler
from stages.engine.step_sampling import Tracked, sample_step

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, decoding: TextDecoding) -> None:
        """Load ``config.parts`` of the model and allocate the KV pool. Prompts arrive as token ids
        (built beside the engine, see ``stages.loading``); ``decoding`` turns output ids into text."""
        self.device = config.torch_device  # ValueError naming --device if that GPU is not there
        if self.device.type == "cpu":
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.dtype = config.dtype_choice  # the dtype of the weights and the pool, and why (/server_info)
        torch_dtype = getattr(torch, self.dtype.name)
        start = memory_at_start(config, self.device)  # before the weights: what was free (GPU sizing only)
        self.adapter = load_adapter(config.model, torch_dtype, ATTENTION_NAME, config.parts, self.device)
        self.decoding = decoding
        text = self.adapter.text_config
        self.max_model_len = config.max_model_len or text.max_position_embeddings
        self.vocab_size = self.adapter.lm_head.out_features
        one_block = KVLayout(num_blocks=1, num_layers=text.num_hidden_layers, block_size=config.block_size,
                             num_kv_heads=text.num_key_value_heads, dtype=torch_dtype,
                             head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        # ValueError naming --kv-cache-mib, --gpu-memory-utilization or --max-model-len when it cannot fit
        self.kv_sizing = size_pool(config, start, self.device, one_block, text, self.max_model_len)
        self.layout = replace(one_block, num_blocks=self.kv_sizing.blocks)
        log.info("KV pool: %d blocks, %.1f MiB (%s); dtype %s (%s)", self.layout.num_blocks, self.kv_sizing.bytes / 2**20,
                 self.kv_sizing.source, self.dtype.name, self.dtype.source)
        self.pool = KVPool(self.layout, self.device)
        self.allocator = BlockAllocator(self.layout.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.batched_tokens, config.kv_allocation)
        self.runner = ModelRunner(self.adapter, self.pool)
        self._tracked: dict[str, Tracked] = {}  # every request in the scheduler, by id
        self._swapped: dict[str, torch.Tensor] = {}  # the host copy of each swapped-out request's KV
        self._forked: list[tuple[Request, Request]] = []  # (sequence 0, a fork) of the step's pass

    # --- admission (all-or-nothing) ----------------------------------------------------------
    def check_request(self, prompt: Prompt, params: SamplingParams) -> None:
        """Raise ValueError (message fit for the client) if the request can never run. No side effects."""
        total = len(prompt.token_ids) + params.max_tokens
        if len(prompt.token_ids) >= self.max_model_len or total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(prompt.token_ids)} in the messages, {params.max_tokens} in the completion). "
                "Please reduce the length of the messages or completion."
            )
        prompt.check_images(self.adapter.media_token_ids, prefill=False)
        outside = [token for token, _ in params.logit_bias if not 0 <= token < self.vocab_size]
        if outside:
            raise ValueError(f"logit_bias names token {outside[0]}, not in this model's vocabulary of {self.vocab_size}")
        self.scheduler.check_fits(Request("check", prompt, params))

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, hand_off: bool = False,
                    awaiting: bool = False) -> Request:
        """Queue a request for prefill and decode. With ``hand_off`` (prefill servers) it stops after the
        first token and its final output carries its blocks, which the caller frees with ``free_blocks``.
        With ``awaiting`` (an EPD prefill), the prompt's stand-in embeddings (``ImageEmbedding.pending``)
        are images still coming: its prefill computes up to the first of them it needs and waits for
        ``provide``. Raises ValueError, changing nothing, if the request can never run or its id is in
        use. Returns its sequence 0 (the others are forked from it when its prompt is done)."""
        self._check_new_id(request_id, params.n)
        self.check_request(prompt, params)
        prompt.check_images(self.adapter.media_token_ids, prefill=True)
        request = Request(request_id, prompt, params, hand_off=hand_off, block_hashes=self._block_hashes(prompt))
        if awaiting and prompt.embeddings:
            spans = image_spans(prompt.token_ids, self.adapter.media_token_ids, prompt.image_tokens)
            request.pending = {i: spans[i] for i, e in enumerate(prompt.embeddings) if e.stand_in}
        tracked = self._new_tracked(request)
        self.scheduler.add(request)
        self._tracked[request_id] = tracked
        return request

    def provide(self, request_id: str, index: int, embedding: ImageEmbedding) -> int | None:
        """Give an ``awaiting`` request image ``index``'s embedding (its chunks up to the next image it
        still needs may then run). Returns the prompt tokens it had computed until then (its prefix hit
        included); None if the request is gone (finished or aborted) or has the embedding already.
        ValueError if the embedding does not fill that image's placeholders."""
        request = next((r for r in self.scheduler.sequences(request_id) if index in r.pending), None)
        if request is None:
            return None
        embeddings = request.prompt.embeddings
        assert embeddings is not None
        if embedding.num_tokens != embeddings[index].num_tokens:
            raise ValueError(f"image {index} fills {embeddings[index].num_tokens} placeholder tokens but its "
                             f"embedding has {embedding.num_tokens}")
        embeddings[index] = embedding
        del request.pending[index]
        return request.num_computed

    def prefix_hint(self, prompt: Prompt) -> int:
        """Prompt tokens the prefix cache holds now for ``prompt`` (what its admission would start from).
        Safe to call from another thread (it only reads the index), where it is a hint: blocks may be
        evicted, or cached, before the request is admitted (``admitted_needs`` says what it then needs)."""
        hashes = self._block_hashes(prompt)
        if not hashes:
            return 0
        return len(self.scheduler.cached_blocks(Request("hint", prompt, SamplingParams(), block_hashes=hashes))) \
            * self.config.block_size

    def admitted_needs(self, request_id: str) -> list[int] | None:
        """For an admitted ``awaiting`` request: the pending images it still needs (not wholly inside
        what it has computed, its prefix hit included), in prompt order; None while it waits to be
        admitted; [] if it is gone."""
        sequences = self.scheduler.sequences(request_id)
        if not sequences:
            return []
        request = sequences[0]
        if request.status is RequestStatus.WAITING:
            return None
        return sorted(i for i, (_, end) in request.pending.items() if end > request.num_computed)

    def reserve_blocks(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Blocks for a request whose prompt KV will be written from elsewhere (decode servers): the
        prompt's (on demand; the whole request's when reserving); the caller owns them until it passes
        them to ``add_prefilled`` or ``free_blocks``. Raises ValueError if it can never fit, MemoryError
        if the blocks cannot be taken now (``Scheduler.reserve``); either way nothing is allocated."""
        self.check_request(prompt, params)
        request = Request("reserve", prompt, params)
        self.scheduler.reserve(request)
        return request.blocks

    def reserve_cached(self, prompt: Prompt, params: SamplingParams) -> tuple[list[int], int]:
        """``reserve_blocks`` from the prefix cache (a decode server's own): the longest cached chain of
        the prompt's full blocks comes first, shared (its KV is here already), then fresh blocks.
        Returns the blocks and how many leading ones are cached, which the prefill need not send.
        With prefix caching off, ``(reserve_blocks(...), 0)``. Errors as ``reserve_blocks``."""
        self.check_request(prompt, params)
        request = Request("reserve", prompt, params, block_hashes=self._block_hashes(prompt))
        cached = self.scheduler.reserve(request)
        return request.blocks, cached

    def free_blocks(self, blocks: list[int]) -> None:
        """Drop the caller's reference to each block (shared and cached ones stay with their other holders)."""
        self.allocator.free(blocks)

    def add_prefilled(self, prefilled: Prefilled) -> list[RequestOutput]:
        """Start decoding a request whose prompt KV is already in its blocks and whose first tokens
        came with it, one per sequence (``Prefilled``). Sequences 1..n-1 fork from sequence 0 here.
        Returns each sequence's first output, by index. The engine owns the blocks from this call on:
        if it raises (ValueError: the request can never run, its id is in use, the first tokens are
        not one token id per sequence or the blocks are too few), the blocks are already freed and
        nothing else has changed."""
        prompt, params, blocks, first = prefilled.prompt, prefilled.params, prefilled.blocks, prefilled.first
        try:
            self._check_new_id(prefilled.request_id, params.n)
            self.check_request(prompt, params)
            request = Request(prefilled.request_id, prompt, params, blocks=blocks, num_computed=len(prompt.token_ids),
                              rope_delta=prefilled.rope_delta, num_cached_tokens=prefilled.cached_tokens,
                              block_hashes=self._block_hashes(prompt), preemption=Preemption.SWAP)
            self._check_first(first, params.n)
            need = self.scheduler.blocks_needed(request)
            if len(blocks) < need:
                raise ValueError(f"{len(blocks)} blocks given, the request needs {need}")
            sequences = [request] + [request.fork(i) for i in range(1, params.n)]
            tracked = [self._new_tracked(sequence) for sequence in sequences]
            for sequence, state in zip(sequences, tracked):
                state.prompt_logprobs = first.prompt_logprobs if not sequence.index else None
                state.logprob = None if first.logprobs is None else first.logprobs[sequence.index]
                if not params.greedy:  # the prefill drew the first token from the same seed: skip that draw here
                    self._skip_draw(state.generator)
        except BaseException:
            self.allocator.free(blocks)
            raise
        self.scheduler.add_running(request)
        self._tracked.update((sequence.request_id, state) for sequence, state in zip(sequences, tracked))
        self.scheduler.register(request)  # the prompt's KV is all here: later rooms may skip sending it
        outputs = [self._append_or_fail(sequence, token) for sequence, token in zip(sequences, first.tokens)]
        for child in sequences[1:]:
            self._place(request, child)
        self.scheduler.reap()  # done already (a stop token or max_tokens=1): blocks go back now
        return outputs

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Abort every live sequence of request ``request_id``: one output each (none if none is here)."""
        aborted = [self.scheduler.abort(r.request_id) for r in self.scheduler.sequences(request_id)]
        return [self._finish(request, FinishReason.ABORT) for request in aborted if request is not None]

    # --- running ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduled batch: one output per request in it, except prefills whose chunk left part of
        their prompt for a later step (chunked prefill: no token yet). Requests that fail (images,
        forward, sampling, detokenizing) finish with ``error`` set; the others are not affected."""
        batch = self.scheduler.schedule()
        self._swap(batch)
        if not batch:
            return []
        errors: dict[str, str] = {}  # request id -> why it failed in this step
        encode_missing(self.adapter.encode, self.adapter.media_token_ids, batch.prefills, errors)
        self._forked = []
        tokens = self._forward([r for r in batch.prefills if r.request_id not in errors], batch.decodes, errors)
        outputs = [self._finish(r, FinishReason.ABORT, error=errors[r.request_id]) if r.request_id in errors
                   else self._append_or_fail(r, tokens[r.request_id])
                   for r in batch.requests + [child for _, child in self._forked]
                   if r.request_id in errors or r.request_id in tokens]  # a mid-prompt chunk has no output
        for parent, child in self._forked:
            self._place(parent, child)
        self.scheduler.after_step(batch)
        return outputs

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def kv_ready(self) -> None:
        """Return once the KV written by every finished step is in memory, so that its blocks may be
        handed to a transfer engine (``KVPool.sync``; nothing to wait for on the CPU)."""
        self.pool.sync()

    def stats(self) -> EngineStats:
        allocator, scheduler = self.allocator, self.scheduler
        return EngineStats(scheduler.num_waiting, scheduler.num_running, allocator.num_used, allocator.num_blocks,
                           allocator.num_cached, scheduler.prefix_queries, scheduler.prefix_hit_tokens,
                           dict(scheduler.preemptions))

    # --- internals ---------------------------------------------------------------------------
    def _check_first(self, first: FirstTokens, n: int) -> None:
        """ValueError unless ``first`` holds one token of this vocabulary per sequence (and one logprob,
        if any)."""
        if len(first.tokens) != n:
            raise ValueError(f"{len(first.tokens)} first tokens for {n} sequences")
        if first.logprobs is not None and len(first.logprobs) != n:
            raise ValueError(f"{len(first.logprobs)} first-token logprobs for {n} sequences")
        for token in first.tokens:
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"first token {token} is not in this model's vocabulary of {self.vocab_size}")

    def _check_new_id(self, request_id: str, n: int = 1) -> None:
        """ValueError if a live sequence belongs to request ``request_id`` or has the id one of its ``n`` would."""
        if any(sequence_id(request_id, i) in self._tracked for i in range(n)) or self.scheduler.sequences(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")

    def _new_tracked(self, request: Request) -> Tracked:
        params = request.params
        return Tracked(self.decoding.detokenizer(params.stop), make_generator(params.seed_of(request.index), self.device),
                        None if params.guide is None else params.guide.matcher(),
                        prompt_logprobs=None if params.prompt_logprobs is None else [None] * request.prompt_len)

    def _block_hashes(self, prompt: Prompt) -> list[bytes] | None:
        """The prompt's chain of block hashes when prefix caching is on, else None. Each image's key
        is hashed with its grid where the prompt has them (pixels or embeddings): an EPD reference
        claims its size, so one key could come with another grid (other M-RoPE positions), and a block
        computed under one must never be a hit for the other, even before its embedding is read."""
        if not self.config.prefix_caching:
            return None
        keys, grids = prompt.image_keys, prompt.image_grids
        if keys is not None and len(grids) == len(keys):
            keys = [f"{key}|{grid}" for key, grid in zip(keys, grids)]
        return block_hashes(prompt.token_ids, self.config.block_size, self.adapter.media_token_ids,
                            prompt.image_tokens, keys)

    def _swap(self, batch: ScheduledBatch) -> None:
        """Copy the KV of the step's swapped-out requests to the host (their blocks are free from this
        step on, so first), then that of its swapped-in requests into their new blocks."""
        for request, blocks in batch.swap_out:
            self._swapped[request.request_id] = self.pool.copy_out(blocks)
        for request, blocks in batch.swap_in:
            self.pool.copy_in(blocks, self._swapped.pop(request.request_id))

    def _forward(self, prefills: list[Request], decodes: list[Request], errors: dict[str, str]) -> dict[str, int]:
        """Run one forward pass over ``prefills`` + ``decodes`` and sample each that has logits (a
        prefill only once its prompt is complete); returns the tokens of those that succeed and
        records why the others failed in ``errors``.

        If the pass raises, each half is run on its own (down to single requests), so only requests
        whose own pass fails get the error. Re-running is safe: a pass that raises has advanced no
        request (the runner moves ``num_computed`` only after it returns), and the retry writes the
        same KV slots again (every layer, the chunk's slots of prefills, the new slot of decodes), so
        whatever the failed pass wrote is overwritten; a decode's older slots are only read."""
        requests = prefills + decodes
        if not requests:
            return {}
        asking = [r for r in prefills if self._tracked[r.request_id].prompt_logprobs is not None]
        firsts = [r.num_computed for r in asking]  # each chunk's first position
        try:
            logits, prompt_hidden = self.runner.forward(prefills, decodes, asking)
        except Exception as exc:
            if len(requests) == 1:
                errors[requests[0].request_id] = f"{type(exc).__name__}: {exc}"
                return {}
            log.warning("a forward pass over %d requests failed (%s: %s); retrying them in halves",
                        len(requests), type(exc).__name__, exc)
            half, cut = len(requests) // 2, max(0, len(requests) // 2 - len(prefills))
            return {**self._forward(prefills[:half], decodes[:cut], errors),
                    **self._forward(prefills[half:], decodes[cut:], errors)}
        rows = [r for r in prefills if r.prompt_done] + decodes  # the rows of ``logits``
        rows, logits = self._fork(rows, logits, errors)  # n > 1: forks after their sequence 0, its row repeated
        chunks = [(r, first, prompt_hidden[r.request_id]) for r, first in zip(asking, firsts)]
        if not rows and not chunks:
            return {}
        return sample_step([(r, self._tracked[r.request_id]) for r in rows], logits,
                           [(r, self._tracked[r.request_id], first, hidden) for r, first, hidden in chunks],
                           self.runner.lm_head_logits, errors)

    def _fork(self, rows: list[Request], logits: torch.Tensor, errors: dict[str, str]) -> tuple[list[Request], torch.Tensor]:
        """The rows to sample after a pass: each of ``rows`` whose prompt the pass completed as the
        sequence 0 of a request with ``n > 1`` (no output yet) followed by its forks, new and tracked
        (in ``_forked``, placed by ``_place`` once their first token is appended), each drawing from
        the same logits row. A fork whose state cannot be made fails alone (``errors``)."""
        expanded, index = [], []
        for row, request in enumerate(rows):
            expanded.append(request)
            index.append(row)
            if request.index or request.params.n == 1 or request.output_ids:
                continue
            for i in range(1, request.params.n):
                child = request.fork(i)
                self._forked.append((request, child))
                try:
                    tracked = self._new_tracked(child)
                except Exception as exc:  # noqa: BLE001 - this sequence's failure only
                    errors[child.request_id] = f"{type(exc).__name__}: {exc}"
                    continue
                tracked.prompt_logprobs = None  # sequence 0's first output carries them
                self._tracked[child.request_id] = tracked
                expanded.append(child)
                index.append(row)
        if len(expanded) == len(rows):
            return rows, logits
        return expanded, logits[torch.tensor(index, dtype=torch.long, device=logits.device)]

    def _place(self, parent: Request, child: Request) -> None:
        """Run a fork that its first token did not finish (``Scheduler.fork``), copying its KV: the
        parent's last, partial prompt block into the fork's own, or, if it was parked to be swapped
        in later, the prompt's KV to the host."""
        if child.status is RequestStatus.FINISHED:
            return
        block_size = self.allocator.block_size
        full = parent.prompt_len // block_size
        if self.scheduler.fork(parent, child):
            if parent.prompt_len % block_size:
                self.pool.copy_blocks([parent.blocks[full]], [child.blocks[full]])
        elif child.swapped:
            self._swapped[child.request_id] = self.pool.copy_out(
                parent.blocks[: blocks_for_tokens(parent.prompt_len, block_size)])

    def _skip_draw(self, generator: torch.Generator) -> None:
        """Advance ``generator`` exactly as one ``sample()`` draw over this vocabulary does, so a seeded
        request continues on the decode server with the numbers it would have used colocated."""
        torch.multinomial(torch.ones(self.vocab_size, device=self.device), 1, generator=generator)

    def _append_or_fail(self, request: Request, token: int) -> RequestOutput:
        try:
            return self._append(request, token)
        except Exception as exc:  # e.g. the tokenizer cannot decode it: this request's failure only
            log.exception("request %s failed after its forward pass", request.request_id)
            return self._finish(request, FinishReason.ABORT, error=f"{type(exc).__name__}: {exc}")

    def _append(self, request: Request, token: int) -> RequestOutput:
        tracked = self._tracked[request.request_id]
        if tracked.matcher is not None:
            tracked.matcher.accept(token)  # raises if the grammar forbids it: this request fails (_append_or_fail)
        request.output_ids.append(token)
        params = request.params
        stop_token = token in params.stop_token_ids or (not params.ignore_eos and token in self.decoding.eos_token_ids)
        visible = [] if stop_token else [token]
        detokenizer = tracked.detokenizer
        text = detokenizer.add(visible)
        if stop_token or detokenizer.stopped:
            return self._finish(request, FinishReason.STOP, text, [token])
        if request.hand_off or len(request.output_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return self._finish(request, FinishReason.LENGTH, text + detokenizer.add([], final=True), [token])
        return self._output(request, text, [token], tracked=tracked)

    def _finish(self, request: Request, reason: FinishReason, text: str = "", tokens: list[int] | None = None,
                error: str | None = None) -> RequestOutput:
        request.finish(reason)
        tracked = self._tracked.pop(request.request_id, None)
        self._swapped.pop(request.request_id, None)
        return self._output(request, text, tokens or [], error, tracked)

    def _output(self, request: Request, text: str, tokens: list[int], error: str | None = None,
                tracked: Tracked | None = None) -> RequestOutput:
        """The output of ``tokens`` (at most one), with the logprobs ``tracked`` holds for them: the token's
        when the request asks (None if they are not known: a decode whose prefill sent none), and the
        prompt's on the first output with a token."""
        handed = request.hand_off and request.finish_reason not in (None, FinishReason.ABORT)
        logprobs: list[TokenLogprob] | None = None if request.params.logprobs is None else []
        prompt: list[TokenLogprob | None] | None = None
        if tracked is not None and tokens:
            logprob, tracked.logprob = tracked.logprob, None
            prompt, tracked.prompt_logprobs = tracked.prompt_logprobs, None
            logprobs = None if logprobs is None or logprob is None else [logprob]
        return RequestOutput(request.group_id, text, tokens, request.finish_reason, request.prompt_len,
                             len(request.output_ids), error, request.rope_delta,
                             request.blocks if handed and not request.index else None,
                             request.num_cached_tokens, index=request.index, logprobs=logprobs, prompt_logprobs=prompt)

