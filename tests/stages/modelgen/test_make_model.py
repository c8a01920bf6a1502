"""`stages.modelgen.make_model`: random-weight checkpoints that load and run like real ones.

The contract the rest of the project relies on: from the output directory alone and offline,
AutoConfig / AutoTokenizer / AutoImageProcessor / AutoModelForImageTextToText load; special-token ids in
the tokenizer match the config; the family's processor (built without a video processor) expands each
image to as many placeholder tokens as the vision tower yields; and `generate()` runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stages.modelgen import FAMILIES, SIZES, make_model

REPO = Path(__file__).resolve().parents[3]

# variant -> (family, vision, text)
VARIANTS = {
    "qwen2_vl": ("qwen2_vl", None, None),
    "qwen2_5_vl": ("qwen2_5_vl", None, None),
    "qwen3_vl": ("qwen3_vl", None, None),
    "llava_clip_llama": ("llava", "clip", "llama"),
    "llava_siglip_qwen2": ("llava", "siglip", "qwen2"),
}
# PIL sizes are (width, height)
IMAGE_SIZES = [(64, 64), (128, 96)]
# tokens per image for the sizes above, pinned so a change to the size presets is a visible decision
EXPECTED_IMAGE_TOKENS = {
    "qwen2_vl": [4, 15],
    "qwen2_5_vl": [4, 15],
    "qwen3_vl": [4, 12],
    "llava_clip_llama": [16, 16],
    "llava_siglip_qwen2": [16, 16],
}
CHAT = [
    {
        "role": "user",
        "content": [
            {"type": "image"},
            {"type": "text", "text": "What is in this picture?"},
        ],
    }
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """variant -> (path, config, tokenizer, image processor, model), each built and loaded once."""
    loaded = {}

    def get(variant: str):
        if variant not in loaded:
            import torch
            from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

            family, vision, text = VARIANTS[variant]
            path = make_model(family, "tiny", tmp_path_factory.mktemp(variant) / "model", vision=vision, text=text)
            loaded[variant] = (
                path,
                AutoConfig.from_pretrained(path),
                AutoTokenizer.from_pretrained(path),
                AutoImageProcessor.from_pretrained(path),
                AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32),
            )
        return loaded[variant]

    return get


def image(size: tuple[int, int]):
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.mark.unit
def test_constants_match_cli_choices():
    assert FAMILIES == ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")
    assert SIZES == ("tiny", "small")


def test_import_does_not_load_torch():
    code = "import sys, stages.modelgen; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_layout(tiny, variant):
    path, config, tok, ip, model = tiny(variant)
    files = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "README.md",
    } <= files
    # the Qwen families ship their video processor config as JSON (its class needs torchvision); LLaVA none
    assert {name for name in files if "video" in name} == (set() if variant.startswith("llava") else
                                                           {"video_preprocessor_config.json"})
    assert "random weights" in (path / "README.md").read_text()
    assert tok.chat_template, "the chat template did not survive a save/load round trip"
    assert model.dtype.is_floating_point and str(model.dtype) == "torch.float32"
    assert config.text_config.vocab_size >= len(tok)
    assert config.text_config.vocab_size % 64 == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_special_token_ids_match_config(tiny, variant):
    path, config, tok, ip, model = tiny(variant)
    text = config.text_config
    gen = model.generation_config
    eos = [gen.eos_token_id] if isinstance(gen.eos_token_id, int) else gen.eos_token_id
    assert tok.eos_token_id == text.eos_token_id == eos[0]
    assert tok.pad_token_id == text.pad_token_id == gen.pad_token_id
    assert text.bos_token_id == gen.bos_token_id == tok.bos_token_id
    if config.model_type == "llava":
        named = {"<image>": config.image_token_id}
        assert config.image_token_index == config.image_token_id
    else:
        named = {
            "<|image_pad|>": config.image_token_id,
            "<|video_pad|>": config.video_token_id,
            "<|vision_start|>": config.vision_start_token_id,
            "<|vision_end|>": config.vision_end_token_id,
            "<|im_start|>": tok.convert_tokens_to_ids("<|im_start|>"),
            "<|im_end|>": text.eos_token_id,
        }
    for token, token_id in named.items():
        assert tok.encode(token, add_special_tokens=False) == [token_id], token
        assert tok.decode([token_id]) == token
    # the tokenizer adds nothing on its own: the chat template writes BOS where the family wants one
    assert tok.encode("a b", add_special_tokens=True) == tok.encode("a b", add_special_tokens=False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_processor_prompt_matches_vision_tokens_and_generate_runs(tiny, variant):
    from stages.modelgen.processor import hf_processor

    path, config, tok, ip, model = tiny(variant)
    processor = hf_processor(path, config=config, tokenizer=tok, image_processor=ip)
    prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    for size, expected in zip(IMAGE_SIZES, EXPECTED_IMAGE_TOKENS[variant]):
        inputs = processor(text=[prompt], images=[image(size)], return_tensors="pt")
        n_image_tokens = int((inputs["input_ids"] == config.image_token_id).sum())
        assert n_image_tokens == expected, size
        if config.model_type == "llava":
            assert n_image_tokens == config.image_seq_length
        else:
            merge = ip.merge_size**2
            assert n_image_tokens == int(inputs["image_grid_thw"].prod()) // merge
            assert inputs["pixel_values"].shape[0] == int(inputs["image_grid_thw"].prod())
            # placeholder count from the image size alone (what a decode stage computes without pixels)
            assert ip.get_number_of_image_patches(size[1], size[0], {}) // merge == n_image_tokens
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert 1 <= len(new) <= 8
    # the random head is muted for every special token but EOS, so no placeholder is ever generated
    specials = set(tok.all_special_ids) - {config.text_config.eos_token_id}
    assert not specials & set(new)


def test_qwen3_vl_has_deepstack(tiny):
    path, config, tok, ip, model = tiny("qwen3_vl")
    assert config.vision_config.deepstack_visual_indexes
    assert max(config.vision_config.deepstack_visual_indexes) < config.vision_config.depth - 1
    assert len(config.vision_config.deepstack_visual_indexes) <= config.text_config.num_hidden_layers


def test_qwen_chat_template(tiny):
    tok = tiny("qwen2_vl")[2]
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "?"}]},
    ]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(system, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_llava_chat_templates(tiny):
    llama = tiny("llava_clip_llama")[2]
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "Sure?"},
    ]
    assert llama.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<s>USER: <image>\nWhat is this?\nASSISTANT: A cat.</s>\nUSER: Sure?\nASSISTANT:"
    )
    qwen2 = tiny("llava_siglip_qwen2")[2]
    assert qwen2.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<image>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_llava_auto_processor(tiny):
    from transformers import AutoProcessor

    path, config, tok, ip, model = tiny("llava_clip_llama")
    processor = AutoProcessor.from_pretrained(path)
    prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[image((64, 64))], return_tensors="pt")
    assert int((inputs["input_ids"] == config.image_token_id).sum()) == config.image_seq_length


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    from stages.modelgen.tokenizer import _trained

    a = make_model("qwen2_vl", "tiny", tmp_path / "a", seed=0)
    _trained.cache_clear()  # train the tokenizer again rather than reuse this process's copy
    b = make_model("qwen2_vl", "tiny", tmp_path / "b", seed=0)
    c = make_model("qwen2_vl", "tiny", tmp_path / "c", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_generation_leaves_global_rng_alone(tmp_path):
    import torch

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_model("llava", "tiny", tmp_path / "m", seed=7)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"family": "gemma3"}, ValueError),
        ({"family": "qwen2_vl", "size": "huge"}, ValueError),
        ({"family": "qwen2_vl", "vision": "clip"}, ValueError),
        ({"family": "llava", "text": "mistral"}, ValueError),
    ],
)
def test_bad_arguments(tmp_path, kwargs, error):
    with pytest.raises(error):
        make_model(**{"size": "tiny", "out": tmp_path / "m", **kwargs})
    assert not (tmp_path / "m").exists()


@pytest.mark.unit
def test_refuses_non_empty_out(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--out"):
        make_model("qwen2_vl", "tiny", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


@pytest.mark.timeout(120)
def test_small_size(tmp_path):
    """One family at benchmark size (~10 s): about 50M parameters and a ~32k vocabulary."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    path = make_model("llava", "small", tmp_path / "small")
    with safe_open(path / "model.safetensors", "pt") as f:
        n_params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    assert 40e6 <= n_params <= 60e6
    config, tok = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert config.text_config.vocab_size >= 30_000
    assert len(tok) >= 30_000 and config.text_config.vocab_size >= len(tok)
    assert config.text_config.max_position_embeddings >= 8192
    # common words are whole tokens
    assert len(tok.encode(" the picture of a house", add_special_tokens=False)) == 5


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_a_cached_model_an_older_generator_made_is_remade(tmp_path):
    """``ensure_model`` (``stage up``'s default model, cached by name) keeps a checkpoint of this
    generator's version and remakes one without it (made before the tool-format templates)."""
    from stages.launch.models import ensure_model
    from stages.modelgen import GENERATOR_VERSION, VERSION_FILE

    path = ensure_model(tmp_path / "qwen2_vl-tiny", "qwen2_vl", "tiny")
    assert (path / VERSION_FILE).read_text() == f"{GENERATOR_VERSION}\n"
    made = (path / "config.json").stat().st_mtime_ns
    assert ensure_model(path, "qwen2_vl", "tiny") == path and (path / "config.json").stat().st_mtime_ns == made
    (path / VERSION_FILE).unlink()
    (path / "stale.txt").write_text("left by the old one")
    assert ensure_model(path, "qwen2_vl", "tiny") == path
    assert (path / VERSION_FILE).exists() and not (path / "stale.txt").exists()
