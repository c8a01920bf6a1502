"""What a model-running stage loads: its engine and, beside it, its prompt builder.

The engine takes token ids and pixels or embeddings; it owns no tokenizer and no image processor.
The prompt builder (``stages.prompt``) owns the tokenizer, and the engine gets only its
detokenizers and end-of-sequence ids (``text_decoding``). Each role loads only what it runs:

    role                          engine parts (EngineConfig.parts)   prompt builder
    colocated                     vision + text                       pixels (image processor)
    prefill, PD mode              vision + text (encodes itself)      pixels
    prefill, EPD (--redis-url)    text                                sizes only (embeddings from the cache)
    decode                        text                                sizes only (no pixels, in any mode)
    encoder                       vision (stages/encoder; no engine)  -

Every prompt builder gets its ``guides`` (``stages.guided.GuideCompiler``), over the same tokenizer,
the engine's vocabulary width and end-of-sequence ids: a request's structured output is compiled
where its prompt is built (the decode too, which holds the matcher in PD).
"""

from __future__ import annotations

from stages.engine.config import VISION, EngineConfig
from stages.engine.engine import Engine
from stages.guided import GuideCompiler
from stages.prompt import PromptBuilder, load_tokenizer, text_decoding


def load_engine(config: EngineConfig, *, pixels: bool) -> tuple[Engine, PromptBuilder]:
    """Load ``config.parts`` of the model into an engine, and its prompt builder (one tokenizer for
    both). ``pixels``: the builder preprocesses images, which the engine then encodes (so the vision
    half must be loaded); else it builds prompts from image sizes and holds no image processor."""
    if pixels and VISION not in config.parts:
        raise ValueError(f"a stage that takes pixels encodes them: it must load the vision half (parts={config.parts})")
    tokenizer = load_tokenizer(config.model)
    decoding = text_decoding(config.model, tokenizer)
    engine = Engine(config, decoding)
    builder = PromptBuilder.load(config.model, engine.adapter, pixels=pixels, tokenizer=tokenizer)
    builder.guides = GuideCompiler(tokenizer, engine.vocab_size, decoding.eos_token_ids)
    return engine, builder
