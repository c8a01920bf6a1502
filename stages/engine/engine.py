"""The synchronous engine: one model, one KV pool, one scheduler. Driven by one thread.

Entry points, each usable alone (the encoder, prefill and decode servers each use one or two):

- ``encode(images)``: images -> embeddings (vision tower + projector);
- ``prefill(requests)``: prompts (+ embeddings) -> KV in each request's blocks, and the first token;
- ``decode(requests)``: one step over KV in each request's blocks -> the next token;
- ``step()``: what the colocated server runs in a loop: schedule, encode new images, one packed
  forward pass over prefills and decodes together, sample, detokenize, finish.

Not thread-safe: exactly one thread calls into an Engine (see ``AsyncEngine``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoImageProcessor, AutoTokenizer, GenerationConfig

from stages.engine.attention import ATTENTION_NAME
from stages.engine.block_allocator import BlockAllocator
from stages.engine.config import EngineConfig
from stages.engine.detokenizer import IncrementalDetokenizer
from stages.engine.kv_pool import KVLayout, KVPool
from stages.engine.models import load_adapter
from stages.engine.multimodal import ImageEmbedding, ImageInput, Prompt
from stages.engine.request import FinishReason, Request
from stages.engine.runner import ModelRunner
from stages.engine.sampler import make_generator, sample
from stages.engine.sampling_params import SamplingParams
from stages.engine.scheduler import ScheduledBatch, Scheduler
from stages.prompt import PromptBuilder


@dataclass
class RequestOutput:
    """What one step produced for one request: new text and tokens, and how it ended if it did."""

    request_id: str
    text: str  # new visible text (stop tokens and stop strings are not shown)
    token_ids: list[int]  # tokens sampled this step, shown or not
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    rope_delta: int = 0
    blocks: list[int] | None = None  # a finished hand-off request's blocks, now owned by the caller

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.adapter = load_adapter(config.model, config.torch_dtype, ATTENTION_NAME, config.parts)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.prompts = PromptBuilder(self.tokenizer, AutoImageProcessor.from_pretrained(config.model), self.adapter)
        text = self.adapter.text_config
        self.max_model_len = config.max_model_len or text.max_position_embeddings
        self.layout = KVLayout.for_budget(
            config.kv_cache_mib << 20,
            num_layers=text.num_hidden_layers,
            block_size=config.block_size,
            num_kv_heads=text.num_key_value_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            dtype=config.torch_dtype,
        )
        self.pool = KVPool(self.layout)
        self.allocator = BlockAllocator(self.layout.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_batched_tokens)
        self.runner = ModelRunner(self.adapter, self.pool)
        self.eos_token_ids = _eos_ids(config.model, self.tokenizer)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._generators: dict[str, torch.Generator] = {}

    # --- admission ---------------------------------------------------------------------------
    def check_request(self, prompt: Prompt, params: SamplingParams) -> None:
        """Raise ValueError (message fit for the client) if the request can never run. No side effects."""
        total = len(prompt.token_ids) + params.max_tokens
        if len(prompt.token_ids) >= self.max_model_len or total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(prompt.token_ids)} in the messages, {params.max_tokens} in the completion). "
                "Please reduce the length of the messages or completion."
            )
        placeholders = prompt.token_ids.count(self.adapter.image_token_id)
        filled = sum(e.num_tokens for e in prompt.embeddings) if prompt.embeddings is not None else sum(
            im.num_tokens for im in prompt.images)
        if placeholders != filled:
            raise ValueError(f"prompt has {placeholders} image placeholder tokens but its images fill {filled}")
        self.scheduler.check_fits(Request("check", prompt, params))

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, hand_off: bool = False) -> Request:
        """Queue a request for prefill and decode. With ``hand_off`` (prefill servers) it stops after the
        first token and its final output carries its blocks, which the caller frees with ``free_blocks``."""
        self.check_request(prompt, params)
        request = Request(request_id, prompt, params, hand_off=hand_off)
        self.scheduler.add(request)
        self._track(request)
        return request

    def reserve_blocks(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Blocks for a whole request whose prompt KV will be written from elsewhere (decode servers).
        Raises ValueError if it can never fit, MemoryError if not enough blocks are free now."""
        probe = Request("reserve", prompt, params)
        self.check_request(prompt, params)
        return self.allocator.allocate(self.scheduler.blocks_needed(probe))

    def free_blocks(self, blocks: list[int]) -> None:
        self.allocator.free(blocks)

    def add_prefilled(self, request_id: str, prompt: Prompt, params: SamplingParams, blocks: list[int],
                      first_token: int, rope_delta: int) -> RequestOutput:
        """Start decoding a request whose prompt KV is already in ``blocks`` (from ``reserve_blocks``)
        and whose first token came with it. The engine now owns the blocks."""
        request = Request(request_id, prompt, params, blocks=blocks, num_computed=len(prompt.token_ids),
                          rope_delta=rope_delta)
        self._track(request)
        if not params.greedy:  # the prefill drew the first token from the same seed: skip that draw here
            self._skip_draw(self._generators[request_id])
        self.scheduler.add_running(request)
        output = self._append(request, first_token)
        self.scheduler.reap()  # done already (a stop token or max_tokens=1): blocks go back now
        return output

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        return self._finish(request, FinishReason.ABORT) if request else None

    # --- the three entry points --------------------------------------------------------------
    def encode(self, images: list[ImageInput]) -> list[ImageEmbedding]:
        return self.adapter.encode(images)

    def prefill(self, requests: list[Request]) -> list[int]:
        """Prefill fresh requests whose blocks are reserved; returns each one's first token."""
        return self._forward(requests, [])

    def decode(self, requests: list[Request]) -> list[int]:
        """One decode step for running requests; returns each one's next token."""
        return self._forward([], requests)

    # --- the colocated loop ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        try:
            self._encode_missing(batch.prefills)
            tokens = self._forward(batch.prefills, batch.decodes)
        except Exception as exc:  # a failed step fails its requests, never the engine
            return self._fail(batch, f"{type(exc).__name__}: {exc}")
        outputs = [self._append(request, token) for request, token in zip(batch.requests, tokens)]
        self.scheduler.after_step(batch)
        return outputs

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # --- internals ---------------------------------------------------------------------------
    def _encode_missing(self, requests: list[Request]) -> None:
        pending = [r for r in requests if r.prompt.embeddings is None]
        embeddings = iter(self.encode([image for r in pending for image in r.prompt.images]))
        for request in pending:
            request.prompt.embeddings = [next(embeddings) for _ in request.prompt.images]

    def _forward(self, prefills: list[Request], decodes: list[Request]) -> list[int]:
        logits = self.runner.forward(prefills, decodes)
        requests = prefills + decodes
        return sample(logits, [r.params for r in requests], [self._generators[r.request_id] for r in requests])

    def _skip_draw(self, generator: torch.Generator) -> None:
        """Advance ``generator`` exactly as one ``sample()`` draw over this vocabulary does, so a seeded
        request continues on the decode server with the numbers it would have used colocated."""
        torch.multinomial(torch.ones(self.adapter.lm_head.out_features), 1, generator=generator)

    def _track(self, request: Request) -> None:
        self._detokenizers[request.request_id] = IncrementalDetokenizer(self.tokenizer, request.params.stop)
        self._generators[request.request_id] = make_generator(request.params.seed)

    def _append(self, request: Request, token: int) -> RequestOutput:
        request.output_ids.append(token)
        params = request.params
        stop_token = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        visible = [] if stop_token else [token]
        detokenizer = self._detokenizers[request.request_id]
        text = detokenizer.add(visible)
        if stop_token or detokenizer.stopped:
            return self._finish(request, FinishReason.STOP, text, [token])
        if request.hand_off or len(request.output_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return self._finish(request, FinishReason.LENGTH, text + detokenizer.add([], final=True), [token])
        return self._output(request, text, [token])

    def _finish(self, request: Request, reason: FinishReason, text: str = "", tokens: list[int] | None = None,
                error: str | None = None) -> RequestOutput:
        request.finish(reason)
        self._detokenizers.pop(request.request_id, None)
        self._generators.pop(request.request_id, None)
        return self._output(request, text, tokens or [], error)

    def _output(self, request: Request, text: str, tokens: list[int], error: str | None = None) -> RequestOutput:
        handed = request.hand_off and request.finish_reason not in (None, FinishReason.ABORT)
        return RequestOutput(request.request_id, text, tokens, request.finish_reason, request.prompt_len,
                             len(request.output_ids), error, request.rope_delta, request.blocks if handed else None)

    def _fail(self, batch: ScheduledBatch, error: str) -> list[RequestOutput]:
        outputs = [self._finish(request, FinishReason.ABORT, error=error) for request in batch.requests]
        self.scheduler.after_step(batch)
        return outputs


def _eos_ids(model: str, tokenizer) -> frozenset[int]:
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else (eos or []))
