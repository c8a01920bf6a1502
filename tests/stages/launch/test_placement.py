"""Where ``stage up`` and ``stage demo`` put each stage, over which transfer, for every torch build
(``stages.launch.placement``): the machines are faked (tests/support/machines.py), the decision is the real one."""

from __future__ import annotations

import pytest

from stages.launch.placement import Machine, place
from stages.launch.stack import STAGE_ROLES
from tests.support.machines import BOTH_NIXL, CPU, NON_CUDA, cuda

pytestmark = pytest.mark.unit
EPD, PD, COLOCATED = STAGE_ROLES["epd"], STAGE_ROLES["pd"], STAGE_ROLES["colocated"]
CU12_MOONCAKE, CU13_MOONCAKE = ("mooncake-transfer-engine",), ("mooncake-transfer-engine-cuda13",)


def test_a_cpu_torch_puts_every_stage_on_the_cpu_over_mooncake():
    for roles in (EPD, PD, COLOCATED):
        placement = place(roles, (), None, CPU)
        assert placement.devices == ("cpu",) * len(roles)
        assert placement.memory_shares == (None,) * len(roles)
    assert place(EPD, (), None, CPU).transfer == "mooncake"
    assert place(PD, (), "nixl", CPU).transfer == "nixl"
    assert place(COLOCATED, (), None, CPU).transfer is None  # colocated moves no KV


@pytest.mark.parametrize("build, mooncake", [("cu12", CU12_MOONCAKE), ("cu13", CU13_MOONCAKE)])
def test_a_cuda_torch_with_the_matching_mooncake_runs_on_the_gpu_over_mooncake(build, mooncake):
    one = place(EPD, (), None, cuda(build, 1, mooncake))
    assert one.devices == ("cuda:0",) * 3
    assert one.memory_shares == (None, 0.4, 0.4)  # the encoder keeps 0.1 of the shared 0.9
    assert one.transfer == "mooncake"
    assert one.describe() == ("encoder cuda:0, prefill cuda:0 (0.4 of it), decode cuda:0 (0.4 of it); "
                              "KV over mooncake")
    assert place(PD, (), None, cuda(build, 1, mooncake)).memory_shares == (0.45, 0.45)
    three = place(EPD, (), None, cuda(build, 3, mooncake))
    assert (three.devices, three.memory_shares) == (("cuda:0", "cuda:1", "cuda:2"), (None, None, None))
    two = place(EPD, (), None, cuda(build, 2, mooncake))
    assert (two.devices, two.memory_shares) == (("cuda:0", "cuda:0", "cuda:1"), (None, 0.8, None))
    assert place(COLOCATED, (), None, cuda(build, 4, mooncake)).devices == ("cuda:0",)


@pytest.mark.parametrize("build", ["cu12", "cu13"])
def test_a_host_only_mooncake_beside_a_cuda_torch_falls_back_to_nixl_or_is_refused_by_name(build):
    machine = cuda(build, 2, NON_CUDA)
    assert place(PD, (), None, machine).transfer == "nixl"
    with pytest.raises(ValueError) as err:
        place(PD, (), "mooncake", machine)
    want = {"cu12": "mooncake-transfer-engine", "cu13": "mooncake-transfer-engine-cuda13"}[build]
    assert str(err.value) == (
        f"--transfer mooncake: the installed mooncake-transfer-engine-non-cuda cannot register GPU memory; rerun "
        f"scripts/setup.sh (it installs {want}, the build for torch {machine.torch_version}), or --transfer nixl, "
        "or --device cpu")
    assert place(PD, ("cpu",), "mooncake", machine).transfer == "mooncake"  # host memory: any build moves it


def test_no_transfer_that_can_move_gpu_memory_is_one_line_naming_the_fix():
    machine = cuda("cu13", 1, NON_CUDA, nixl=("nixl-cu12",))  # a NIXL wheel of the wrong CUDA major
    with pytest.raises(ValueError) as err:
        place(EPD, (), None, machine)
    assert str(err.value) == (
        "no KV transfer can move GPU memory here: the installed nixl-cu12 does not match torch 2.13.0+cu130; "
        "rerun scripts/setup.sh (it installs the builds that match torch), or --transfer mooncake, or --device cpu")
    with pytest.raises(ValueError, match=r"^--transfer nixl: NIXL is not installed; rerun scripts/setup.sh"):
        place(PD, (), "nixl", Machine("2.13.0+cpu", "cpu", 0, NON_CUDA, ()))


def test_a_gpu_torch_does_not_see_is_refused_before_anything_starts():
    with pytest.raises(ValueError) as err:
        place(EPD, ("cuda",), None, CPU)
    assert str(err.value) == ("--device cuda: torch 2.13.0+cpu sees no GPU (a CPU build of torch, or no driver: stage "
                              "env says which); use --device cpu, or rerun scripts/setup.sh with a CUDA torch")
    with pytest.raises(ValueError, match=r"^--device cuda:2: torch sees 2 GPU\(s\); use cuda:N with N < 2$"):
        place(PD, ("cuda:0", "cuda:2"), None, cuda("cu13", 2, CU13_MOONCAKE))
    with pytest.raises(ValueError, match=r"^--device takes one device for every stage or one per stage"):
        place(EPD, ("cpu", "cpu"), None, CPU)
    with pytest.raises(ValueError, match=r"^--device must be"):
        place(PD, ("gpu0",), None, CPU)


def test_explicit_devices_are_taken_as_given_and_auto_entries_resolved():
    machine = cuda("cu13", 2, CU13_MOONCAKE, nixl=BOTH_NIXL)
    placement = place(EPD, ("cpu", "auto", "cuda:1"), None, machine)
    assert placement.devices == ("cpu", "cuda:0", "cuda:1")
    assert placement.memory_shares == (None, None, None)  # nothing shares a GPU
    same = place(PD, ("cuda",), None, machine)
    assert (same.devices, same.memory_shares) == (("cuda:0", "cuda:0"), (0.45, 0.45))
