"""``model_dir_problem`` on fabricated checkpoint directories (a few bytes each, no torch): what a role
needs is there, and what is wrong is one line naming the file. The CLI's side (exit 2 before any
import of torch) is tests/cli/test_bad_checkpoint.py."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from stages.chat_template import find_chat_template
from stages.model_dir import SUPPORTED_MODEL_TYPES, model_dir_problem
from stages.weight_files import safetensors_problem

pytestmark = pytest.mark.unit
TEMPLATE = "{{ messages[0]['content'] }}"


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data))


def shard(path: Path, n: int = 4) -> Path:
    save_file({"w": np.arange(n, dtype=np.float32)}, str(path))
    return path


def checkpoint(root: Path, *, shards: int = 0, template: str | None = "jinja", model_type: str = "qwen2_vl") -> Path:
    """A directory with what every role reads: one model.safetensors, or ``shards`` shards and their index."""
    root.mkdir()
    write_json(root / "config.json", {"model_type": model_type, "architectures": ["Qwen2VLForConditionalGeneration"]})
    write_json(root / "preprocessor_config.json", {"min_pixels": 3136, "max_pixels": 50176})
    (root / "tokenizer.json").write_text("{}")
    write_json(root / "tokenizer_config.json", {"chat_template": TEMPLATE} if template == "config" else {})
    if template == "jinja":
        (root / "chat_template.jinja").write_text(TEMPLATE)
    elif template == "json":
        write_json(root / "chat_template.json", {"chat_template": TEMPLATE})
    if not shards:
        shard(root / "model.safetensors")
        return root
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    for name in names:
        shard(root / name)
    write_json(root / "model.safetensors.index.json",
               {"metadata": {}, "weight_map": {f"t{i}": name for i, name in enumerate(names)}})
    return root


def test_the_supported_model_types_are_the_adapters():
    from stages.engine.models import ADAPTERS

    assert SUPPORTED_MODEL_TYPES == tuple(sorted(ADAPTERS))


@pytest.mark.parametrize("shards", [0, 3])
@pytest.mark.parametrize("template", ["jinja", "json", "config"])
def test_a_whole_checkpoint_passes_wherever_its_chat_template_is(tmp_path, shards, template):
    path = checkpoint(tmp_path / "m", shards=shards, template=template)
    assert model_dir_problem(path, tokenizer=True) is None
    assert find_chat_template(path) == ({"jinja": "chat_template.jinja", "json": "chat_template.json",
                                         "config": "tokenizer_config.json"}[template], TEMPLATE)


def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    path = checkpoint(tmp_path / "m", model_type="gemma3")
    write_json(path / "config.json", {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]})
    assert model_dir_problem(path, tokenizer=False) == (
        "config.json: model_type 'gemma3' (Gemma3ForConditionalGeneration) is not supported; "
        "supported: llava, qwen2_5_vl, qwen2_vl, qwen3_vl")
    write_json(path / "config.json", {"architectures": ["LlamaForCausalLM"]})
    assert model_dir_problem(path, tokenizer=False) == (
        "config.json: no model_type (LlamaForCausalLM) is not supported; supported: llava, qwen2_5_vl, qwen2_vl, qwen3_vl")
    (path / "config.json").write_text("{not json")
    assert model_dir_problem(path, tokenizer=False).startswith("config.json does not parse as JSON (")


def test_a_missing_chat_template_is_refused_where_a_tokenizer_is_read(tmp_path):
    path = checkpoint(tmp_path / "m", template=None)
    assert model_dir_problem(path, tokenizer=True) == (
        "no chat template in it (chat_template.jinja, chat_template.json, or a chat_template field in "
        "tokenizer_config.json)")
    assert model_dir_problem(path, tokenizer=False) is None  # the encoder never renders a conversation
    (path / "chat_template.json").write_text("{")
    assert model_dir_problem(path, tokenizer=True).startswith("chat_template.json does not parse as JSON (")


def test_several_named_templates_give_the_default(tmp_path):
    path = checkpoint(tmp_path / "m", template=None)
    write_json(path / "tokenizer_config.json", {"chat_template": [{"name": "tool_use", "template": "x"},
                                                                  {"name": "default", "template": TEMPLATE}]})
    assert find_chat_template(path) == ("tokenizer_config.json", TEMPLATE)


def test_a_shard_the_index_names_must_be_there(tmp_path):
    path = checkpoint(tmp_path / "m", shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    assert model_dir_problem(path, tokenizer=True) == (
        "model-00002-of-00003.safetensors is missing (named in model.safetensors.index.json)")


def test_shards_without_their_index_name_the_index(tmp_path):
    path = checkpoint(tmp_path / "m", shards=2)
    (path / "model.safetensors.index.json").unlink()
    assert model_dir_problem(path, tokenizer=True) == (
        "model.safetensors.index.json is missing (it names the shards: model-00001-of-00002.safetensors, "
        "model-00002-of-00002.safetensors)")
    (path / "model.safetensors.index.json").write_text("[]")
    assert model_dir_problem(path, tokenizer=True).startswith("model.safetensors.index.json does not parse as an index")


def test_no_weights_at_all(tmp_path):
    path = checkpoint(tmp_path / "m")
    (path / "model.safetensors").unlink()
    assert model_dir_problem(path, tokenizer=True) == "no weights in it (*.safetensors, pytorch_model*.bin)"
    (path / "pytorch_model.bin").write_bytes(b"")  # pickles are not read: present is all that is checked
    assert model_dir_problem(path, tokenizer=True) is None


@pytest.mark.parametrize("cut", [1, 16, 40])
def test_a_truncated_shard_is_named(tmp_path, cut):
    path = checkpoint(tmp_path / "m", shards=2)
    name = "model-00002-of-00002.safetensors"
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[:-cut])
    problem = model_dir_problem(path, tokenizer=True)
    assert problem is not None and problem.startswith(f"{name} is truncated ("), problem


def test_safetensors_headers(tmp_path):
    whole = shard(tmp_path / "a.safetensors", n=8)
    assert safetensors_problem(whole) is None
    size = whole.stat().st_size
    (n,) = struct.unpack("<Q", whole.read_bytes()[:8])
    whole.write_bytes(whole.read_bytes()[:size - 4])
    assert safetensors_problem(whole) == f"a.safetensors is truncated ({size - 4} of {size} bytes)"
    whole.write_bytes(whole.read_bytes()[:20])
    assert safetensors_problem(whole) == f"a.safetensors is truncated (20 bytes, its header alone takes {8 + n})"
    whole.write_bytes(b"abc")
    assert safetensors_problem(whole) == "a.safetensors is truncated (3 bytes, shorter than a safetensors header)"
    padded = shard(tmp_path / "b.safetensors")
    padded.write_bytes(padded.read_bytes() + b"\0" * 5)
    assert safetensors_problem(padded) == "b.safetensors is not a safetensors file (5 bytes after its last tensor)"
    garbage = tmp_path / "c.safetensors"
    garbage.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    assert safetensors_problem(garbage).startswith("c.safetensors is not a safetensors file (its header does not parse")
    huge = tmp_path / "d.safetensors"
    huge.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    assert safetensors_problem(huge) == f"d.safetensors is not a safetensors file (a header of {2**40} bytes)"
