"""Runs the language model over one packed step: prompts to prefill and requests to decode.

The runner owns no scheduling decisions. It reads each request's prompt, blocks and progress,
builds the packed inputs (token embeddings with image embeddings spliced in, per-token positions
including Qwen M-RoPE deltas, KV slots), runs the model's own decoder layers with paged attention,
and returns the logits of each request's last position. It advances ``num_computed`` and sets
``rope_delta`` on prefilled requests; everything else about a request is the engine's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.engine.attention import AttentionMetadata, build_decode_group
from stages.engine.kv_pool import KVPool
from stages.engine.models.base import ModelAdapter
from stages.engine.multimodal import ImageEmbedding
from stages.engine.request import Request


@dataclass
class PackedStep:
    token_ids: list[int]
    positions: list[torch.Tensor]  # each [rows, n]
    slot_blocks: list[torch.Tensor]
    slot_offsets: list[torch.Tensor]
    spans: list[tuple[int, int]]
    image_rows: list[int]
    embeddings: list[ImageEmbedding]
    last_rows: list[int]


# The LM head over many rows runs as matmuls over column chunks of a transposed weight copy: on a
# CPU the chunk stays in cache (measured: 32 rows x 32k vocab, 51 -> 31 ms, same bits). Fewer rows
# use the model's own layer, which is what generate() runs, so single requests match it bit for bit.
LM_HEAD_CHUNK = 2048
LM_HEAD_CHUNKED_ROWS = 8


class ModelRunner:
    def __init__(self, adapter: ModelAdapter, pool: KVPool) -> None:
        self.adapter = adapter
        self.pool = pool
        self.block_size = pool.layout.block_size
        self._lm_head_t = adapter.lm_head.weight.detach().t().contiguous()  # [hidden, vocab]

    @torch.inference_mode()
    def forward(self, prefills: list[Request], decodes: list[Request]) -> torch.Tensor:
        """Logits [len(prefills) + len(decodes), vocab] in float32, prefills first."""
        step = self._pack(prefills, decodes)
        decode_group = None
        if decodes:
            decode_group = build_decode_group(
                start=len(step.token_ids) - len(decodes),
                blocks=[r.blocks for r in decodes],
                lengths=[r.num_computed + 1 for r in decodes],
                block_size=self.block_size,
            )
        meta = AttentionMetadata(
            pool=self.pool,
            slot_blocks=torch.cat(step.slot_blocks),
            slot_offsets=torch.cat(step.slot_offsets),
            prefill_spans=step.spans,
            decode=decode_group,
        )
        hidden = self._run_layers(step, meta)
        logits = self._logits(hidden[0, step.last_rows]).float()
        for request in prefills:
            request.num_computed = request.prompt_len
        for request in decodes:
            request.num_computed += 1
        return logits

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        head = self.adapter.lm_head
        if rows.shape[0] < LM_HEAD_CHUNKED_ROWS or getattr(head, "bias", None) is not None:
            return head(rows)
        vocab = self._lm_head_t.shape[1]
        out = rows.new_empty((rows.shape[0], vocab))
        for start in range(0, vocab, LM_HEAD_CHUNK):
            end = min(start + LM_HEAD_CHUNK, vocab)
            torch.matmul(rows, self._lm_head_t[:, start:end], out=out[:, start:end])
        return out

    def _pack(self, prefills: list[Request], decodes: list[Request]) -> PackedStep:
        step = PackedStep([], [], [], [], [], [], [], [])
        rows = self.adapter.position_rows
        for request in prefills:
            start, ids = len(step.token_ids), request.prompt.token_ids
            positions, request.rope_delta = self.adapter.prefill_positions(ids, request.prompt.image_grids)
            self._add_tokens(step, request, ids, positions, first_slot=0)
            step.spans.append((start, len(step.token_ids)))
            self._add_images(step, request, start)
        for request in decodes:
            position = request.num_computed + request.rope_delta
            self._add_tokens(step, request, [request.last_token], torch.full((rows, 1), position), request.num_computed)
        return step

    def _add_tokens(self, step: PackedStep, request: Request, ids: list[int], positions: torch.Tensor, first_slot: int) -> None:
        slots = torch.arange(first_slot, first_slot + len(ids))
        step.slot_blocks.append(torch.tensor(request.blocks, dtype=torch.long)[slots // self.block_size])
        step.slot_offsets.append(slots % self.block_size)
        step.token_ids.extend(ids)
        step.positions.append(positions)
        step.last_rows.append(len(step.token_ids) - 1)

    def _add_images(self, step: PackedStep, request: Request, start: int) -> None:
        embeddings = request.prompt.embeddings or []
        ids = torch.tensor(request.prompt.token_ids)
        # Engine.check_request has made sure the placeholders and the images' tokens agree
        step.image_rows.extend((torch.nonzero(ids == self.adapter.image_token_id).flatten() + start).tolist())
        step.embeddings.extend(embeddings)

    def _run_layers(self, step: PackedStep, meta: AttentionMetadata) -> torch.Tensor:
        text = self.adapter.text_model
        embeds = text.embed_tokens(torch.tensor(step.token_ids))
        image_rows = torch.tensor(step.image_rows, dtype=torch.long)
        if step.embeddings:
            embeds[image_rows] = torch.cat([e.embeds for e in step.embeddings]).to(embeds.dtype)
        hidden = embeds.unsqueeze(0)
        positions = torch.cat(step.positions, dim=1)
        position_ids = positions.unsqueeze(1) if self.adapter.position_rows > 1 else positions
        position_embeddings = text.rotary_emb(hidden, position_ids)
        for index, layer in enumerate(text.layers):
            hidden = layer(hidden, attention_mask=None, position_embeddings=position_embeddings, epd_attn=meta)
            hidden = self.adapter.layer_hook(index, hidden, image_rows, step.embeddings)
        return text.norm(hidden)
