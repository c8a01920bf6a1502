"""Runs the language model over one packed step: prompts to prefill and requests to decode.

The runner owns no scheduling decisions. It reads each request's prompt, blocks and progress,
builds the packed inputs (token embeddings with image embeddings spliced in, per-token positions
including Qwen M-RoPE deltas, KV slots), runs the model's own decoder layers with paged attention,
and returns the logits of each request's last position (and, for prompt logprobs, the hidden
states of a chunk's prompt positions). It advances ``num_computed`` and sets
``rope_delta`` on prefilled requests; everything else about a request is the engine's business.

Chunked prefill: a prefill computes its chunk ``[num_computed, chunk_end)`` of the prompt. The
chunk's positions are that slice of the whole prompt's positions, its image rows take the matching
rows of the images' embeddings (an image may straddle chunks), and a chunk after the first attends
to the earlier prompt tokens' K/V in the pool (``attention.PrefillContext``). A whole prompt in one
chunk takes exactly the path it always did. Only a chunk that completes its prompt yields logits.

Devices: the step's inputs are built on the host as plain lists (``PackedStep``), then each becomes
one tensor made on the pool's device; image embeddings (which may come from the cache on the CPU)
are moved there once per step. Nothing in a step makes a tensor without naming its device
(tests/stages/engine/test_device_placement.py runs steps with torch's default device set to ``meta``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace

import torch

from stages.engine.attention import AttentionMetadata, PrefillContext, build_decode_group, build_prefill_context, decode_kernel
from stages.engine.kv_pool import KVPool
from stages.engine.models.base import ModelAdapter
from stages.engine.multimodal import ImageEmbedding, slice_embeddings
from stages.engine.request import Request


@dataclass
class PackedStep:
    """One step's inputs on the host: every packed token's id, position (one list per position row),
    KV slot; each prefill's span; the packed rows of image tokens and their embeddings; the last row
    of each request."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[list[int]] = field(default_factory=list)  # [rows][tokens]
    slot_blocks: list[int] = field(default_factory=list)
    slot_offsets: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    context_lengths: list[int] = field(default_factory=list)  # per span: earlier prompt tokens already in the pool
    image_rows: list[int] = field(default_factory=list)
    embeddings: list[ImageEmbedding] = field(default_factory=list)
    last_rows: list[int] = field(default_factory=list)


# On the CPU the LM head over many rows runs as matmuls over column chunks of a transposed weight
# copy: the chunk stays in cache (measured: 32 rows x 32k vocab, 51 -> 31 ms, same bits). Fewer rows
# use the model's own layer, which is what generate() runs, so single requests match it bit for bit.
# A GPU always uses the model's own layer (and holds no copy).
LM_HEAD_CHUNK = 2048
LM_HEAD_CHUNKED_ROWS = 8


class ModelRunner:
    def __init__(self, adapter: ModelAdapter, pool: KVPool) -> None:
        self.adapter = adapter
        self.pool = pool
        self.device = pool.device
        self.block_size = pool.layout.block_size
        self.decode_kernel = decode_kernel(self.device, pool.layout.dtype, self.block_size, pool.layout.head_dim)
        self._lm_head_t = None  # [hidden, vocab], CPU only
        if self.device.type == "cpu":
            self._lm_head_t = adapter.lm_head.weight.detach().t().contiguous()

    @torch.inference_mode()
    def forward(self, prefills: list[Request], decodes: list[Request],
                prompt_positions: Collection[Request] = ()) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Logits [prompts completed + len(decodes), vocab] in float32 on the device: one row per
        prefill whose chunk completes its prompt (in order), then one per decode. A prefill computes
        its chunk ``[num_computed, chunk_end)``. Second, for each prefill in ``prompt_positions`` (prompt
        logprobs), by request id: the final hidden states [P, hidden] of its chunk's positions ``p``
        that predict a prompt token (``p + 1 < prompt_len``, in order; possibly none), which
        ``lm_head_logits`` turns into logits."""
        step = self._pack(prefills, decodes)
        decode_group = None
        if decodes:
            decode_group = build_decode_group(
                start=len(step.token_ids) - len(decodes),
                blocks=[r.blocks for r in decodes],
                lengths=[r.num_computed + 1 for r in decodes],
                block_size=self.block_size,
                device=self.device,
                kernel=self.decode_kernel,
            )
        meta = AttentionMetadata(
            pool=self.pool,
            slot_blocks=self._tensor(step.slot_blocks),
            slot_offsets=self._tensor(step.slot_offsets),
            prefill_spans=step.spans,
            decode=decode_group,
            prefill_contexts=self._contexts(prefills, step),
        )
        hidden = self._run_layers(step, meta)
        self.pool.mark_written()
        logits = self.lm_head_logits(hidden[0, self._tensor(step.last_rows)])
        prompt_hidden = {r.request_id: hidden[0, start:start + max(0, min(r.chunk_end, r.prompt_len - 1) - r.num_computed)]
                         for r, (start, _) in zip(prefills, step.spans) if r in prompt_positions}
        for request in prefills:
            request.num_computed = request.chunk_end
        for request in decodes:
            request.num_computed += 1
        return logits, prompt_hidden

    @torch.inference_mode()
    def lm_head_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Final hidden states [R, hidden] -> float32 logits [R, vocab]."""
        return self._logits(rows).float()

    def _tensor(self, values: list) -> torch.Tensor:
        """An int64 tensor of ``values`` made on the device (one host-to-device copy)."""
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        head = self.adapter.lm_head
        if self._lm_head_t is None or rows.shape[0] < LM_HEAD_CHUNKED_ROWS or getattr(head, "bias", None) is not None:
            return head(rows)
        vocab = self._lm_head_t.shape[1]
        out = rows.new_empty((rows.shape[0], vocab))
        for start in range(0, vocab, LM_HEAD_CHUNK):
            end = min(start + LM_HEAD_CHUNK, vocab)
            torch.matmul(rows, self._lm_head_t[:, start:end], out=out[:, start:end])
        return out

    def _contexts(self, prefills: list[Request], step: PackedStep) -> list[PrefillContext | None]:
        """Per prefill span: the pool slots of its prompt so far, for a chunk after the first."""
        return [build_prefill_context(r.blocks, context, end - start, self.block_size, self.device) if context else None
                for r, (start, end), context in zip(prefills, step.spans, step.context_lengths)]

    def _pack(self, prefills: list[Request], decodes: list[Request]) -> PackedStep:
        step = PackedStep(positions=[[] for _ in range(self.adapter.position_rows)])
        for request in prefills:
            first, last = request.num_computed, request.chunk_end
            start, ids = len(step.token_ids), request.prefill_ids
            positions = self._prefill_positions(request)
            self._add_tokens(step, request, ids[first:last], positions[:, first:last].tolist(), first_slot=first)
            if last < request.prefill_len:
                step.last_rows.pop()  # a chunk that leaves tokens for later yields no logits
            step.spans.append((start, len(step.token_ids)))
            step.context_lengths.append(first)
            self._add_images(step, request, start)
        for request in decodes:
            position = request.num_computed + request.rope_delta
            rows = [[position]] * self.adapter.position_rows
            self._add_tokens(step, request, [request.last_token], rows, request.num_computed)
        return step

    def _prefill_positions(self, request: Request) -> torch.Tensor:
        """Positions [rows, prefill_len] of a request's prefill (and its ``rope_delta`` set): the prompt's,
        then for the output tokens of a recompute text positions, index + rope delta on every row, as
        a decode's."""
        prompt = request.prompt
        positions, request.rope_delta = self.adapter.prefill_positions(prompt.token_ids, prompt.image_grids,
                                                                       prompt.video_plans)
        if not request.recompute_outputs:
            return positions
        outputs = torch.arange(request.prompt_len, request.prefill_len, device="cpu") + request.rope_delta
        return torch.cat([positions, outputs.expand(positions.shape[0], -1).to(positions.dtype)], dim=1)

    def _add_tokens(self, step: PackedStep, request: Request, ids: list[int], positions: list[list[int]],
                    first_slot: int) -> None:
        slots = range(first_slot, first_slot + len(ids))
        step.slot_blocks.extend(request.blocks[slot // self.block_size] for slot in slots)
        step.slot_offsets.extend(slot % self.block_size for slot in slots)
        step.token_ids.extend(ids)
        for row, values in zip(step.positions, positions):
            row.extend(values)
        step.last_rows.append(len(step.token_ids) - 1)

    def _add_images(self, step: PackedStep, request: Request, start: int) -> None:
        """The chunk's image rows and, for each image it overlaps, the matching rows of its embedding."""
        # only the prompt's tokens are images: a recomputed output token is text, whatever its id
        media, first = self.adapter.media_token_ids, request.num_computed
        last = min(request.chunk_end, request.prompt_len)
        if first >= last:
            return
        # Engine.check_request has made sure the placeholders and the images' tokens agree
        ids = request.prompt.token_ids
        rows = [start + i - first for i in range(first, last) if ids[i] in media]
        step.image_rows.extend(rows)
        before = sum(1 for token in ids[:first] if token in media)  # image and video tokens of earlier chunks
        step.embeddings.extend(slice_embeddings(request.prompt.embeddings or [], before, before + len(rows)))

    def _on_device(self, embedding: ImageEmbedding) -> ImageEmbedding:
        """``embedding`` with its tensors on the device (those from the cache arrive on the CPU)."""
        deepstack = embedding.deepstack
        return replace(embedding, embeds=embedding.embeds.to(self.device),
                       deepstack=None if deepstack is None else deepstack.to(self.device))

    def _run_layers(self, step: PackedStep, meta: AttentionMetadata) -> torch.Tensor:
        text = self.adapter.text_model
        embeds = text.embed_tokens(self._tensor(step.token_ids))
        image_rows = self._tensor(step.image_rows)
        embeddings = [self._on_device(e) for e in step.embeddings]
        if embeddings:
            embeds[image_rows] = torch.cat([e.embeds for e in embeddings]).to(embeds.dtype)
        hidden = embeds.unsqueeze(0)
        positions = self._tensor(step.positions)
        position_ids = positions.unsqueeze(1) if self.adapter.position_rows > 1 else positions
        position_embeddings = text.rotary_emb(hidden, position_ids)
        for index, layer in enumerate(text.layers):
            hidden = layer(hidden, attention_mask=None, position_embeddings=position_embeddings, epd_attn=meta)
            hidden = self.adapter.layer_hook(index, hidden, image_rows, embeddings)
        return text.norm(hidden)
