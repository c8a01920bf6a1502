"""A hub-layout checkpoint that cannot load (``stages.model_dir``), given to the real CLI: one line on
stderr naming the file, exit 2, before torch is imported and before any server starts. Each case is a
copy of the tiny hub-layout Qwen2-VL (tests/support/generated_models.py) with one thing broken."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.cli.test_mistakes import assert_one_line
from tests.support.generated_models import model_dir

pytestmark = pytest.mark.timeout(120)


def truncate_second_shard(path: Path) -> str:
    shard = sorted(path.glob("model-*-of-*.safetensors"))[1]
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:size // 2])
    return f"{shard.name} is truncated ({size // 2} of {size} bytes)"


def drop_last_shard(path: Path) -> str:
    shard = sorted(path.glob("model-*-of-*.safetensors"))[-1]
    shard.unlink()
    return f"{shard.name} is missing (named in model.safetensors.index.json)"


def unsupported_architecture(path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gemma3",
                                                  "architectures": ["Gemma3ForConditionalGeneration"]}))
    return ("config.json: model_type 'gemma3' (Gemma3ForConditionalGeneration) is not supported; "
            "supported: llava, qwen2_5_vl, qwen2_vl, qwen3_vl")


def no_chat_template(path: Path) -> str:
    (path / "chat_template.json").unlink()
    return ("no chat template in it (chat_template.jinja, chat_template.json, or a chat_template field in "
            "tokenizer_config.json)")


@pytest.mark.parametrize("breakage", [truncate_second_shard, drop_last_shard, unsupported_architecture,
                                      no_chat_template])
def test_a_broken_hub_checkpoint_is_one_line_naming_the_file(breakage, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(model_dir("qwen2_vl", hub=True), path)
    why = breakage(path)
    assert_one_line(("serve", "colocated", "--model", str(path), "--port", "0"),
                    f"stage serve colocated: error: --model {path}: {why}")
