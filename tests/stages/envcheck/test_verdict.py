"""``stage env``'s verdicts over faked facts: each role ok, or not with the fix named, for the machines
users hit (CPU torch, a CUDA torch beside the host-only Mooncake, no GPU, Redis down, no libibverbs)."""

from __future__ import annotations

import pytest

from stages.envcheck.verdict import resolve_device, verdicts
from tests.stages.envcheck.fakes import CUDA12, machine

pytestmark = pytest.mark.unit

LIBIBVERBS = "ImportError: libibverbs.so.1: cannot open shared object file: No such file or directory"


def by_role(facts, device="auto", transfers=("mooncake", "nixl")):
    return {v.role: v for v in verdicts(facts, device, transfers)}


def test_cpu_torch_with_the_host_only_mooncake_is_ok_on_the_cpu():
    judged = by_role(machine(torch="cpu"), transfers=("mooncake",))
    assert {role: v.ok for role, v in judged.items()} == {"encoder": True, "prefill": True, "decode": True}
    assert judged["decode"].transfers == ("mooncake",) and judged["decode"].problems == ()
    assert judged["encoder"].notes == ("Redis not checked: give --redis-url (stage up starts one of its own)",)


def test_cuda_torch_with_the_host_only_mooncake_on_a_gpu_names_its_fix_and_is_ok_via_nixl():
    judged = by_role(machine(torch="cu12", gpus=1))
    fix = ("mooncake: mooncake-transfer-engine-non-cuda cannot register GPU memory: rerun scripts/setup.sh "
           f"(it installs {CUDA12}) or use --transfer nixl")
    for role in ("prefill", "decode"):
        assert judged[role].ok and judged[role].transfers == ("nixl",)
        assert judged[role].notes == (fix,)
    only_mooncake = by_role(machine(torch="cu12", gpus=1), transfers=("mooncake",))
    assert not only_mooncake["decode"].ok and only_mooncake["decode"].problems == (fix,)
    assert only_mooncake["encoder"].ok  # the encoder moves no KV


def test_the_cuda_mooncake_beside_a_cuda_torch_can_move_gpu_kv():
    judged = by_role(machine(torch="cu12", gpus=2, mooncake=(CUDA12,)), device="cuda:1")
    assert judged["decode"].ok and judged["decode"].transfers == ("mooncake", "nixl") and judged["decode"].notes == ()


def test_nixl_without_the_wheel_of_torchs_cuda_cannot_register_gpu_memory():
    judged = by_role(machine(torch="cu13", gpus=1, nixl=("nixl-cu12",)), transfers=("nixl",))
    assert judged["prefill"].problems == ("nixl: cannot register GPU memory (nixl-cu13 is not installed): rerun "
                                          "scripts/setup.sh or use --transfer mooncake",)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_gpu_asked_for_where_torch_sees_none_fails_every_role(device):
    judged = by_role(machine(torch="cpu"), device=device)
    expected = (f"--device {device}: torch sees no GPU here (a CPU build of torch, or no driver); use --device cpu",)
    assert {role: (v.ok, v.problems) for role, v in judged.items()} == {
        "encoder": (False, expected), "prefill": (False, expected), "decode": (False, expected)}


def test_a_gpu_index_past_the_last_is_refused():
    assert resolve_device("cuda:2", 2) == (None, "--device cuda:2: torch sees 2 GPU(s); use cuda:N with N < 2")
    assert resolve_device("cuda", 2) == ("cuda:0", None)
    assert resolve_device("auto", 0) == ("cpu", None)
    assert resolve_device("auto", 1) == ("cuda:0", None)


def test_an_unreachable_redis_fails_the_encoder_and_the_epd_prefill_not_the_decode():
    judged = by_role(machine(redis=False))
    down = "Redis at redis://:***@10.0.0.5:6379/0 does not answer: start it, or fix --redis-url"
    assert (judged["encoder"].ok, judged["encoder"].problems) == (False, (down,))
    assert (judged["prefill"].ok, judged["prefill"].problems) == (
        False, (f"{down} (in EPD mode the prefill reads the embeddings there)",))
    assert judged["decode"].ok
    assert all(v.ok and not v.problems for v in verdicts(machine(redis=True)))


def test_a_mooncake_that_does_not_import_for_lack_of_libibverbs_names_the_packages():
    only_mooncake = by_role(machine(mooncake_error=LIBIBVERBS), transfers=("mooncake",))
    fix = (f"mooncake: does not import ({LIBIBVERBS}): apt-get install libibverbs1 librdmacm1 (scripts/setup.sh "
           "does) or use --transfer nixl")
    assert (only_mooncake["decode"].ok, only_mooncake["decode"].problems) == (False, (fix,))
    both = by_role(machine(mooncake_error=LIBIBVERBS))
    assert both["decode"].ok and both["decode"].transfers == ("nixl",) and both["decode"].notes == (fix,)


def test_no_backend_at_all_lists_each_ones_fix():
    judged = by_role(machine(mooncake=(), nixl=()))
    assert judged["decode"].problems == (
        "mooncake: not installed: rerun scripts/setup.sh (it installs mooncake-transfer-engine-non-cuda) or use "
        "--transfer nixl",
        "nixl: not installed: rerun scripts/setup.sh or use --transfer mooncake")
    assert judged["encoder"].ok


def test_two_mooncake_builds_at_once_are_a_problem():
    judged = by_role(machine(mooncake=("mooncake-transfer-engine-non-cuda", CUDA12)), transfers=("mooncake",))
    assert not judged["prefill"].ok
    assert "overwrite each other's files" in judged["prefill"].problems[0]


def test_torch_that_does_not_import_fails_every_role():
    judged = by_role(machine(torch=None))
    assert not any(v.ok for v in judged.values())
    assert judged["encoder"].problems == (
        "torch does not import (ModuleNotFoundError: No module named 'torch'): rerun scripts/setup.sh",)
