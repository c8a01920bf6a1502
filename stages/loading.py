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
where its prompt is built (the decode too, which holds the matcher in PD). It also gets its
``defaults``: the checkpoint's sampling defaults (``generation_config.json``, read as
``--generation-config`` says; ``stages.generation_defaults``), which a prefill and its decode compare
when they pair (``transfer.fingerprint``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from stages.engine.config import VISION, EngineConfig
from stages.engine.engine import Engine
from stages.generation_defaults import FILE, GenerationDefaults, from_generation_config, ignored, sampled_but_greedy
from stages.guided import GuideCompiler
from stages.prompt import PromptBuilder, load_tokenizer, text_decoding

_log = logging.getLogger(__name__)


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
    builder.defaults = generation_defaults(config.model, config.generation_config)
    return engine, builder


def generation_defaults(model_dir: str | Path, mode: str) -> GenerationDefaults:
    """The sampling defaults of ``model_dir``'s ``generation_config.json`` under ``--generation-config
    mode``: none for ``none`` or a checkpoint without the file. ValueError naming the flag for a file
    that is no JSON object or sets a value a request could not; a warning for a field vLLM would take
    and this server cannot (``min_p``), and for sampling fields beside ``do_sample: false``."""
    path = Path(model_dir) / FILE
    if mode == "none" or not path.is_file():
        return GenerationDefaults()
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}; fix the file or start with --generation-config none") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object; fix the file or start with --generation-config none")
    defaults = from_generation_config(config)
    if skipped := ignored(config):
        _log.warning("%s sets %s, which this server does not support; ignored", path, ", ".join(skipped))
    if sampled := sampled_but_greedy(config):
        _log.warning("%s sets do_sample false beside %s: applied as defaults (vLLM's reading), where generate() "
                     "would decode greedily; a request that wants greedy sends temperature 0", path, ", ".join(sampled))
    if defaults.to_json():
        _log.info("sampling defaults from %s (--generation-config %s): %s", path, mode, defaults.to_json())
    return defaults
