"""transfer/build_choice.py: the Mooncake and NIXL builds for every torch build (CPU, CUDA 12.x, 13.x),
what is uninstalled first when another build is there, an unsupported CUDA refused, and the lines
scripts/setup.sh reads. The installed builds are given (faked); the decision is the real one."""

from __future__ import annotations

import pytest

from transfer.build_choice import BuildChoice, choose, main, render

pytestmark = pytest.mark.unit
NON_CUDA, CU12, CU13 = "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "mooncake-transfer-engine-cuda13"


@pytest.mark.parametrize("cuda, build, mooncake, nixl", [
    (None, "cpu", NON_CUDA, "nixl-cu13"),
    ("", "cpu", NON_CUDA, "nixl-cu13"),
    ("12.4", "cu12", CU12, "nixl-cu12"),
    ("12.8", "cu12", CU12, "nixl-cu12"),
    ("13.0", "cu13", CU13, "nixl-cu13"),
    ("13.2", "cu13", CU13, "nixl-cu13"),
])
def test_each_torch_build_gets_its_mooncake_and_one_nixl_wheel(cuda, build, mooncake, nixl):
    choice = choose(cuda, [], [], driver=True)
    assert choice == BuildChoice(build, True, mooncake, nixl, ())
    assert choice.install == (f"{mooncake}>=0.3.13", f"{nixl}==1.5.1")
    assert choice.install_no_deps == ("nixl==1.5.1",)  # the meta package, without both wheels


@pytest.mark.parametrize("cuda, nixl", [("12.4", "nixl-cu12"), ("13.0", "nixl-cu13")])
def test_a_cuda_torch_without_the_driver_gets_the_host_memory_mooncake(cuda, nixl):
    """A CUDA build of Mooncake fails to import without libcuda.so.1; NIXL's wheel of torch's CUDA loads."""
    choice = choose(cuda, [CU13], [], driver=False)
    assert (choice.mooncake, choice.nixl_wheel, choice.uninstall) == (NON_CUDA, nixl, (CU13,))
    assert choice.summary("2.13.0+cu130") == (f"transfer builds for torch 2.13.0+cu130: {NON_CUDA}, nixl + {nixl} "
                                              "(no NVIDIA driver, libcuda.so.1: Mooncake's host-memory build)")


@pytest.mark.parametrize("cuda", ["11.8", "10.2", "14.0"])
def test_a_cuda_without_published_builds_is_refused_naming_the_fix(cuda):
    with pytest.raises(ValueError, match=rf"CUDA {cuda}; Mooncake and NIXL publish builds for CUDA 12 and 13 only"):
        choose(cuda, [], [], driver=True)


def test_the_chosen_build_alone_installed_is_kept():
    assert choose("13.0", [CU13], ["nixl-cu13"], driver=True).uninstall == ()


def test_switching_builds_uninstalls_the_old_one():
    assert choose("13.0", [NON_CUDA], [], driver=True).uninstall == (NON_CUDA,)
    assert choose(None, [CU12], [], driver=True).uninstall == (CU12,)


def test_two_builds_installed_are_both_uninstalled_the_chosen_one_too():
    """They overwrote each other's files: uninstalling the other deletes the chosen one's files too."""
    assert choose("12.4", [CU12, NON_CUDA], [], driver=True).uninstall == (CU12, NON_CUDA)


def test_the_other_nixl_wheel_is_uninstalled():
    assert choose(None, [NON_CUDA], ["nixl-cu12", "nixl-cu13"], driver=True).uninstall == ("nixl-cu12",)
    assert choose("12.1", [], ["nixl-cu12", "nixl-cu13"], driver=True).uninstall == ("nixl-cu13",)


def test_summary_names_torch_and_builds_in_one_line():
    assert choose("13.0", [], [], driver=True).summary("2.13.0+cu130") == \
        f"transfer builds for torch 2.13.0+cu130: {CU13}, nixl + nixl-cu13"
    cpu = choose(None, [], [], driver=True).summary("2.13.0+cpu")
    assert cpu.startswith(f"transfer builds for torch 2.13.0+cpu: {NON_CUDA}, nixl + nixl-cu13 (")
    assert "\n" not in cpu


def test_render_gives_setup_sh_one_line_per_field():
    lines = render(choose("12.6", [NON_CUDA], ["nixl-cu13"], driver=True), "2.13.0+cu126").splitlines()
    assert lines == [f"summary transfer builds for torch 2.13.0+cu126: {CU12}, nixl + nixl-cu12",
                     f"uninstall {NON_CUDA} nixl-cu13",
                     f"install {CU12}>=0.3.13 nixl-cu12==1.5.1",
                     "install-no-deps nixl==1.5.1"]


def test_main_refuses_cuda_11_with_exit_2(capsys):
    assert main(["--torch", "2.13.0+cu118", "--cuda", "11.8"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("transfer.build_choice: torch was built for CUDA 11.8;")
