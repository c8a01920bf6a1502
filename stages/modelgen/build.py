"""Write one random-weight checkpoint in the standard Hugging Face layout."""

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import hub, images, llava, qwen, specials, templates, tokenizer
from .processor import llava_processor_kwargs
from .sizes import PRESETS, Size, config_vocab
from .version import GENERATOR_VERSION, VERSION_FILE


@dataclass(frozen=True)
class Recipe:
    """Everything that differs between families, resolved from the make_model arguments."""

    family: str
    size_name: str
    tokens: specials.SpecialTokens
    chat_template: str
    vision: str | None = None  # LLaVA only
    text: str | None = None  # LLaVA only

    @property
    def size(self) -> Size:
        return PRESETS[self.size_name]

    def config(self, vocab: int):
        if self.family == "llava":
            if self.vision is None or self.text is None:
                raise ValueError("a llava recipe names its vision tower and its text model")
            return llava.config(self.size, self.tokens, vocab, self.vision, self.text)
        return qwen.BUILDERS[self.family](self.size, self.tokens, vocab)

    def image_processor(self):
        if self.family == "llava":
            return images.clip(self.size) if self.vision == "clip" else images.siglip(self.size)
        return images.qwen(self.size, qwen.PATCH[self.family], mean_std_half=self.family == "qwen3_vl")


def recipe(family: str, size: str, vision: str | None = None, text: str | None = None) -> Recipe:
    if size not in PRESETS:
        raise ValueError(f"unknown --size {size!r}; choose one of {tuple(PRESETS)}")
    if family == "llava":
        vision, text = vision or "clip", text or "llama"
        if vision not in llava.VISION_TOWERS or text not in llava.TEXT_MODELS:
            raise ValueError(f"--vision must be one of {llava.VISION_TOWERS}, --text one of {llava.TEXT_MODELS}")
        if text == "llama":
            return Recipe(family, size, specials.LLAVA_LLAMA, templates.llava(), vision, text)
        return Recipe(family, size, specials.LLAVA_QWEN2, templates.chatml(templates.LLAVA_IMAGE), vision, text)
    if family not in qwen.BUILDERS:
        raise ValueError(f"unknown --family {family!r}; choose one of {('llava', *qwen.BUILDERS)}")
    if vision is not None or text is not None:
        raise ValueError(f"--vision and --text apply to --family llava only, not to {family}")
    return Recipe(family, size, specials.QWEN, templates.chatml(templates.QWEN_IMAGE, video_placeholder=templates.QWEN_VIDEO))


def random_model(config, seed: int):
    """The model for `config`, weights drawn from `seed` on CPU in float32; the caller's RNG is untouched."""
    import torch
    from transformers import AutoModelForImageTextToText

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    return model.eval()


def mute(model, token_ids: list[int]) -> None:
    """Zero the LM-head rows of `token_ids`: their logit is 0, far below the top of a random model's spread,
    so greedy decoding never emits them (e.g. an image placeholder fed back as a generated token)."""
    import torch

    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if head.data_ptr() == embed.data_ptr():
        raise AssertionError("LM head is tied to the input embeddings; muting would zero input embeddings too")
    with torch.no_grad():
        head[token_ids] = 0.0


def generation_config(tokens: specials.SpecialTokens):
    from transformers import GenerationConfig

    eos = tokens.eos_ids
    return GenerationConfig(
        bos_token_id=tokens.id(tokens.bos),
        eos_token_id=eos if len(eos) > 1 else eos[0],
        pad_token_id=tokens.id(tokens.pad),
        do_sample=False,
    )


def model_card(r: Recipe, architecture: str, seed: int, n_params: int, hub_layout: bool = False) -> str:
    options = f", vision={r.vision}, text={r.text}" if r.family == "llava" else ""
    options += ", hub layout" if hub_layout else ""
    return (
        f"# {r.family} ({r.size_name}{options}): random weights\n\n"
        "This checkpoint has random weights: it was never trained and its output is meaningless. It exists to\n"
        "test and benchmark serving code. Written by `stage make-model`; the tokenizer was trained on generated\n"
        "pseudo-English text.\n\n"
        f"- architecture: {architecture}\n- parameters: {n_params:,}\n- seed: {seed}\n"
    )


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_files(r: Recipe, out: Path, seed: int, hub_layout: bool) -> None:
    tok = tokenizer.wrap(
        tokenizer.train(r.size.text.tokenizer_vocab, r.tokens), r.tokens, r.chat_template, r.size.text.max_positions
    )
    model = random_model(r.config(config_vocab(r.size.text, len(tok))), seed)
    mute(model, [r.tokens.id(t) for t in r.tokens.tokens if t != r.tokens.eos])
    model.generation_config = generation_config(r.tokens)
    n_params = sum(p.numel() for p in model.parameters())
    if hub_layout:
        hub.save_weights(model, out, r.family)  # bfloat16, sharded
    else:
        model.save_pretrained(out)
    tok.save_pretrained(out)
    r.image_processor().save_pretrained(out)
    if r.family != "llava":
        _write_json(out / "video_preprocessor_config.json",
                    images.qwen_video(r.size, qwen.PATCH[r.family], r.family))
    if r.family == "llava":  # lets AutoProcessor work; Qwen's would need a video processor (torchvision)
        processor = {"image_token": r.tokens.image, "processor_class": "LlavaProcessor"}
        _write_json(out / "processor_config.json", {**processor, **llava_processor_kwargs(model.config)})
    if hub_layout:
        hub.apply(out, r.family)
    (out / "README.md").write_text(model_card(r, model.config.architectures[0], seed, n_params, hub_layout))
    (out / VERSION_FILE).write_text(f"{GENERATOR_VERSION}\n")


def write(r: Recipe, out: Path, seed: int, hub_layout: bool = False) -> Path:
    """Write into a fresh sibling directory, then rename it to `out`: readers never see half a checkpoint.

    `out` must not exist or be an empty directory. `hub_layout`: as the family's hub repository ships
    it (`hub.py`), else the standard layout.
    """
    if out.is_dir() and any(out.iterdir()) or out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} exists and is not an empty directory; remove it or choose another")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_files(r, staging, seed, hub_layout)
        for path in staging.iterdir():
            path.chmod(0o644)
        staging.chmod(0o755)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
