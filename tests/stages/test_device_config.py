"""``--device``: validated where it is given, resolved against the machine with an error naming the flag,
on every role that runs a model (the encoder too), and per stage in ``stage up``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cli import build_parser, main
from cli.serve import server_config
from stages.engine.config import BATCHED_TOKENS, EngineConfig, resolve_device
from stages.launch.stack import StackConfig, stage_specs


@pytest.mark.unit
@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "CPU", "cuda:0,cuda:1", ""])
def test_a_malformed_device_is_refused_naming_the_flag(spec):
    with pytest.raises(ValueError, match=r"--device must be auto \(cuda:0 when torch sees a GPU, else cpu\), cpu, "
                                         rf"cuda \(= cuda:0\) or cuda:N; got '{spec}'"):
        EngineConfig(model="/m", device=spec)


@pytest.mark.unit
def test_auto_and_cpu_resolve_here():
    assert EngineConfig(model="/m").device == "auto"
    assert resolve_device("cpu") == torch.device("cpu")
    expected = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    assert EngineConfig(model="/m", device="auto").torch_device == expected


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without a GPU")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_a_gpu_that_is_not_there_is_an_error_naming_the_flag(spec):
    with pytest.raises(ValueError, match=rf"--device {spec}: torch sees no GPU here .*; use --device cpu or auto"):
        EngineConfig(model="/m", device=spec).torch_device


@pytest.mark.unit
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_index_past_the_last_is_an_error_naming_the_flag():
    count = torch.cuda.device_count()
    assert resolve_device("cuda") == torch.device("cuda:0")
    with pytest.raises(ValueError, match=rf"--device cuda:{count}: torch sees {count} GPU\(s\)"):
        resolve_device(f"cuda:{count}")


@pytest.mark.unit
@pytest.mark.parametrize("role", ["colocated", "prefill", "decode", "encoder", "pd"])
def test_every_model_role_takes_device(role):
    extra = ["--redis-url", "redis://127.0.0.1:1/0"] if role == "encoder" else []
    args = build_parser().parse_args(["serve", role, "--model", "/m", "--device", "cuda:1", *extra])
    assert server_config(args, role).engine.device == "cuda:1"


def test_stage_serve_names_the_flag_before_loading_anything(capsys, tiny_model):
    model = str(tiny_model("qwen2_vl"))  # a real checkpoint: the model check passes, the device is what fails
    code = main(["serve", "colocated", "--model", model, "--device", "tpu"])
    assert code == 2
    assert "stage serve colocated: error: --device must be" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["serve", "decode", "--model", model, "--device", "cuda:0"]) == 2
        assert "--device cuda:0: torch sees no GPU here" in capsys.readouterr().err


@pytest.mark.unit
def test_stage_up_gives_each_stage_its_device():
    config = StackConfig(model=Path("/m"), log_dir=Path("/l"), mode="epd", devices=("cuda:0", "cuda:1", "cuda:2"))
    specs = stage_specs(config, iter(range(7001, 7010)))
    devices = [s.argv[s.argv.index("--device") + 1] for s in specs]
    assert [s.role for s in specs] == ["encoder", "prefill", "decode"] and devices == ["cuda:0", "cuda:1", "cuda:2"]
    one = StackConfig(model=Path("/m"), log_dir=Path("/l"), mode="pd", devices=("cpu",))
    assert [s.argv[s.argv.index("--device") + 1] for s in stage_specs(one, iter(range(7001, 7010)))] == ["cpu"] * 2
    default = StackConfig(model=Path("/m"), log_dir=Path("/l"), mode="colocated")
    assert "--device" not in stage_specs(default, iter(range(7001, 7010)))[0].argv
    with pytest.raises(ValueError, match="--device takes one device for every stage or one per stage of --mode pd "
                                         r"\(prefill,decode\), got cuda:0,cuda:1,cuda:2"):
        StackConfig(model=Path("/m"), log_dir=Path("/l"), mode="pd", devices=("cuda:0", "cuda:1", "cuda:2"))
    with pytest.raises(ValueError, match="--device must be"):
        StackConfig(model=Path("/m"), log_dir=Path("/l"), mode="pd", devices=("gpu0",))


@pytest.mark.unit
def test_max_batched_tokens_defaults_to_the_devices_budget_and_is_validated():
    assert EngineConfig(model="/m").max_batched_tokens is None
    assert EngineConfig(model="/m", device="cpu").batched_tokens == BATCHED_TOKENS["cpu"] == 256
    assert EngineConfig(model="/m", device="cpu", max_batched_tokens=8192).batched_tokens == 8192
    expected = BATCHED_TOKENS["cuda" if torch.cuda.is_available() else "cpu"]
    assert EngineConfig(model="/m", device="auto").batched_tokens == expected
    with pytest.raises(ValueError, match=r"^--max-batched-tokens must be > 0, got 0$"):
        EngineConfig(model="/m", max_batched_tokens=0)
