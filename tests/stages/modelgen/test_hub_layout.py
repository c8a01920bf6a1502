"""``make_model(..., hub_layout=True)`` (``stage make-model --hub-layout``): the files are those a hub
repository ships (bfloat16 shards and their index, the chat template in its own file and not in
tokenizer_config.json, the repository's preprocessor fields), and they load to the same model as the
standard layout: the same config, the same weights rounded to bfloat16, the same template and image
processor, and the loader's halves (text, vision) hold exactly the full load's tensors.
Parity with generate() on these checkpoints: tests/stages/engine/test_hub_parity.py (in process, every
family) and tests/e2e/test_hub_layout_stacks.py (one served stack per mode)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from stages.modelgen import hub
from tests.support.generated_models import model_dir

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")
# a few of the keys each hub repository's index names (Qwen2-VL's and Qwen2.5-VL's predate model.language_model)
HUB_KEYS = {
    "qwen2_vl": ("lm_head.weight", "model.embed_tokens.weight", "visual.patch_embed.proj.weight"),
    "qwen2_5_vl": ("lm_head.weight", "model.embed_tokens.weight", "visual.patch_embed.proj.weight"),
    "qwen3_vl": ("lm_head.weight", "model.language_model.embed_tokens.weight", "model.visual.patch_embed.proj.weight"),
    "llava": ("language_model.lm_head.weight", "language_model.model.embed_tokens.weight",
              "vision_tower.vision_model.embeddings.patch_embedding.weight", "multi_modal_projector.linear_1.weight"),
}
TEMPLATE_FILE = {"qwen2_vl": "chat_template.json", "qwen2_5_vl": "chat_template.json",
                 "qwen3_vl": "chat_template.json", "llava": "chat_template.jinja"}


def header_dtypes(shard: Path) -> set[str]:
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return {t["dtype"] for k, t in json.loads(data[8:8 + n]).items() if k != "__metadata__"}


@pytest.mark.unit
def test_shard_size_gives_at_least_three_shards():
    assert hub.shard_bytes(570_000) * hub.MIN_SHARDS < 570_000
    assert hub.shard_bytes(3) == 1


@pytest.mark.unit
def test_hub_config_flattens_qwen2_and_restores_legacy_rope():
    saved = {"model_type": "qwen2_vl", "dtype": "bfloat16", "image_token_id": 5,
             "text_config": {"model_type": "qwen2_vl_text", "dtype": "float32", "hidden_size": 64,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}},
             "vision_config": {"depth": 2, "dtype": "float32"}}
    assert hub.hub_config(saved, "qwen2_vl") == {
        "model_type": "qwen2_vl", "image_token_id": 5, "hidden_size": 64, "rope_theta": 1e6,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "torch_dtype": "bfloat16",
        "vision_config": {"depth": 2, "torch_dtype": "bfloat16"}}
    qwen3 = {**saved, "model_type": "qwen3_vl", "text_config": {**saved["text_config"], "rope_parameters": {
        "rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True}}}
    text = hub.hub_config(qwen3, "qwen3_vl")["text_config"]
    assert text["rope_scaling"] == {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    assert (text["rope_theta"], text["dtype"], "rope_parameters" in text) == (5e6, "bfloat16", False)


@pytest.mark.unit
def test_hub_preprocessor_spells_the_pixel_bounds_as_each_repository_does():
    saved = {"size": {"shortest_edge": 3136, "longest_edge": 50176}, "patch_size": 14,
             "image_processor_type": "Qwen2VLImageProcessor"}
    qwen2 = hub.hub_preprocessor(saved, "qwen2_vl")
    assert (qwen2["min_pixels"], qwen2["max_pixels"], qwen2["size"]) == (3136, 50176, saved["size"])
    assert qwen2["processor_class"] == "Qwen2VLProcessor"
    qwen25 = hub.hub_preprocessor(saved, "qwen2_5_vl")
    assert "size" not in qwen25 and (qwen25["min_pixels"], qwen25["max_pixels"]) == (3136, 50176)
    qwen3 = hub.hub_preprocessor(saved, "qwen3_vl")
    assert "min_pixels" not in qwen3 and qwen3["image_processor_type"] == "Qwen2VLImageProcessorFast"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_files_are_what_the_hub_ships(family):
    path = model_dir(family, hub=True)
    names = {p.name for p in path.iterdir()}
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and "model.safetensors" not in names
    assert set(shards) == {n for n in names if n.endswith(".safetensors")}
    assert all(header_dtypes(path / shard) == {"BF16"} for shard in shards)
    assert set(HUB_KEYS[family]) <= set(index["weight_map"])
    config = json.loads((path / "config.json").read_text())
    assert (config.get("torch_dtype") or config.get("dtype")) == "bfloat16"
    assert ("text_config" in config) == (family not in hub.FLAT)
    assert TEMPLATE_FILE[family] in names and "chat_template" not in json.loads((path / "tokenizer_config.json").read_text())
    assert ({"chat_template.json", "chat_template.jinja"} & names) == {TEMPLATE_FILE[family]}
    processor = json.loads((path / "preprocessor_config.json").read_text())
    assert processor["processor_class"] == hub.PROCESSOR_CLASS[family]
    if family in hub.FLAT:
        assert processor["min_pixels"] < processor["max_pixels"]
    assert {"generation_config.json", "tokenizer.json", "preprocessor_config.json"} <= names


@pytest.mark.parametrize("family", FAMILIES)
def test_it_loads_to_the_standard_layouts_model_rounded_to_bfloat16(family):
    import torch
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText

    from stages.engine.models import load_adapter
    from stages.prompt import load_tokenizer

    std, hub_path = model_dir(family), model_dir(family, hub=True)
    ignore = {"_name_or_path", "dtype", "torch_dtype", "transformers_version"}

    def config(path):
        def strip(d):
            return {k: strip(v) if isinstance(v, dict) else v for k, v in d.items() if k not in ignore}
        data = strip(AutoConfig.from_pretrained(path).to_dict())
        data["text_config"].get("rope_parameters", {}).pop("type", None)  # "mrope", kept from rope_scaling
        return data

    assert config(hub_path) == config(std)
    assert load_tokenizer(hub_path).chat_template == load_tokenizer(std).chat_template
    assert AutoImageProcessor.from_pretrained(hub_path).to_dict() == AutoImageProcessor.from_pretrained(std).to_dict()
    assert AutoModelForImageTextToText.from_pretrained(hub_path).dtype == torch.bfloat16  # the dtype it states
    full = load_adapter(hub_path, torch.float32, "sdpa")
    reference = AutoModelForImageTextToText.from_pretrained(std, dtype=torch.float32).state_dict()
    state = full.model.state_dict()
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k].to(torch.bfloat16).float()) for k in state)
    halves = [load_adapter(hub_path, torch.float32, "sdpa", parts=(part,)) for part in ("text", "vision")]
    assert sum(h.num_parameters for h in halves) == full.num_parameters
    for half in halves:
        assert all(torch.equal(t, state[k]) for k, t in half.model.state_dict().items())
