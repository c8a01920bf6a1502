"""The hub layout (``stage make-model --hub-layout``): a generated checkpoint written the way the
model's own Hugging Face repository ships it, so loading is tested on what users download.

What differs from the standard layout (``build.py``), family by family as the real repositories
(Qwen/Qwen2-VL-7B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct, Qwen/Qwen3-VL-8B-Instruct,
llava-hf/llava-1.5-7b-hf) have it:

- weights in bfloat16, sharded (``model-0000N-of-0000M.safetensors`` and
  ``model.safetensors.index.json``; at least ``MIN_SHARDS`` shards, even for the tiny size), under
  the key names transformers writes for the hub (``model.layers.*`` and ``visual.*`` for Qwen2-VL and
  Qwen2.5-VL, ``language_model.model.*`` for LLaVA), LLaVA's vision tower under
  ``vision_tower.vision_model.*`` as llava-hf's repositories have it (``RENAMED``);
- config.json in the repository's own form: Qwen2-VL and Qwen2.5-VL flat (the language model's
  fields at the top, ``rope_scaling`` ``{"type": "mrope", ...}``, ``torch_dtype``); Qwen3-VL nested
  with ``rope_scaling`` and ``rope_theta`` in ``text_config`` and ``dtype``; LLaVA nested with
  ``torch_dtype``;
- the chat template in its own file, never in tokenizer_config.json: ``chat_template.json`` for the
  Qwen families (what their processors read), ``chat_template.jinja`` for LLaVA (transformers 5's);
- preprocessor_config.json with the fields the repository spells: ``min_pixels``/``max_pixels``
  (Qwen2-VL also ``size``), Qwen3-VL ``size`` only, and each ``processor_class``.

Pure where it can be: ``hub_config`` and ``hub_preprocessor`` map dicts to dicts; ``apply`` rewrites a
written directory's files, ``save_weights`` writes the shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MIN_SHARDS = 3
DTYPE = "bfloat16"
FLAT = ("qwen2_vl", "qwen2_5_vl")  # config.json without text_config on the hub
TEMPLATE_JSON = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # chat_template.json; the others chat_template.jinja
# shard key prefixes written under another name than transformers 5 saves them: (family, saved, hub)
RENAMED = (("llava", "vision_tower.", "vision_tower.vision_model."),)
PROCESSOR_CLASS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                   "qwen3_vl": "Qwen3VLProcessor", "llava": "LlavaProcessor"}


def shard_bytes(total_bytes: int) -> int:
    """A ``max_shard_size`` that cuts ``total_bytes`` of weights into at least ``MIN_SHARDS`` shards."""
    return max(1, total_bytes // (MIN_SHARDS + 1))


def save_weights(model: Any, out: Path, family: str) -> None:
    """``model`` cast to bfloat16 and saved sharded, with its index (config and generation config too),
    under the key names of ``family``'s hub repository."""
    import torch

    model.to(torch.bfloat16)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(out, max_shard_size=shard_bytes(total))
    for renamed_family, saved, hub in RENAMED:
        if renamed_family == family:
            _rename_keys(out, saved, hub)


def _rename_keys(out: Path, saved: str, hub: str) -> None:
    """Every shard key (and index entry) starting with ``saved`` renamed to start with ``hub``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    def rename(key: str) -> str:
        return hub + key[len(saved):] if key.startswith(saved) else key

    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(out / shard, "pt") as f:
            tensors, metadata = {rename(k): f.get_tensor(k) for k in f.keys()}, f.metadata()
        save_file(tensors, out / shard, metadata=metadata)
    index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _legacy_rope(text: dict, family: str) -> dict:
    """``rope_parameters`` back into the ``rope_theta`` + ``rope_scaling`` fields the hub configs carry."""
    rope = dict(text.pop("rope_parameters"))
    text["rope_theta"] = rope.pop("rope_theta")
    if family in FLAT:
        text["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    elif family == "qwen3_vl":
        text["rope_scaling"] = {k: rope[k] for k in ("rope_type", "mrope_section", "mrope_interleaved")}
    else:
        text["rope_scaling"] = None
    return text


def hub_config(config: dict, family: str) -> dict:
    """config.json (as transformers 5 saves it) in the form ``family``'s hub repository has. Pure."""
    key = "dtype" if family == "qwen3_vl" else "torch_dtype"
    out = {k: v for k, v in config.items() if k != "dtype"}
    text = _legacy_rope({k: v for k, v in out.pop("text_config").items() if k != "dtype"}, family)
    vision = {k: v for k, v in out.pop("vision_config").items() if k != "dtype"}
    if family in FLAT:
        text.pop("model_type")
        return {**text, **out, "vision_config": {**vision, key: DTYPE}, key: DTYPE}
    return {**out, "text_config": {**text, key: DTYPE}, "vision_config": {**vision, key: DTYPE}, key: DTYPE}


def hub_preprocessor(config: dict, family: str) -> dict:
    """preprocessor_config.json (as transformers 5 saves it) with the fields ``family``'s hub
    repository spells. Pure."""
    out = {**config, "processor_class": PROCESSOR_CLASS[family]}
    if family in FLAT:
        size = out["size"]
        out.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"],
                   image_processor_type="Qwen2VLImageProcessor")
        if family == "qwen2_5_vl":
            del out["size"]
    elif family == "qwen3_vl":
        out["image_processor_type"] = "Qwen2VLImageProcessorFast"
    return out


def _rewrite_json(path: Path, change) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text())), indent=2, sort_keys=True) + "\n")


def apply(out: Path, family: str) -> None:
    """Rewrite the config, the chat template and the preprocessor config that ``build`` wrote into
    ``out`` in their hub form. RuntimeError if tokenizer_config.json carries a chat template."""
    _rewrite_json(out / "config.json", lambda c: hub_config(c, family))
    _rewrite_json(out / "preprocessor_config.json", lambda c: hub_preprocessor(c, family))
    if "chat_template" in json.loads((out / "tokenizer_config.json").read_text()):
        raise RuntimeError("tokenizer_config.json carries the chat template; the hub layout keeps it in its own file")
    jinja = out / "chat_template.jinja"
    if family in TEMPLATE_JSON:
        (out / "chat_template.json").write_text(json.dumps({"chat_template": jinja.read_text()}, indent=2) + "\n")
        jinja.unlink()
