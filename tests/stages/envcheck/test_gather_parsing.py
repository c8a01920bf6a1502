"""The parsing inside ``stage env``'s probes: the error line of a failed import in a child, the driver
version of /proc/driver/nvidia/version."""

from __future__ import annotations

import pytest

from stages.envcheck.gather import last_error, proc_driver_version

pytestmark = pytest.mark.unit

MOONCAKE_WITHOUT_LIBIBVERBS = """\
Traceback (most recent call last):
  File "<string>", line 1, in <module>
  File "/venv/lib/python3.11/site-packages/mooncake/engine.py", line 1, in <module>
    from mooncake.engine import *
ImportError: libibverbs.so.1: cannot open shared object file: No such file or directory
I1207 13:47:08.123 glog.cc:12] shutting down
"""


def test_the_error_line_of_a_traceback_is_kept_and_glog_lines_after_it_are_skipped():
    assert last_error(MOONCAKE_WITHOUT_LIBIBVERBS) == (
        "ImportError: libibverbs.so.1: cannot open shared object file: No such file or directory")
    assert last_error("Segmentation fault\n") == "Segmentation fault"
    assert last_error("") is None


@pytest.mark.parametrize("text, version", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\nGCC version: gcc 12",
     "535.104.05"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.20  Release Build  (dvs-builder@U16)",
     "570.133.20"),
    ("nothing here", None),
])
def test_the_driver_version_is_read_from_either_kernel_module(text, version):
    assert proc_driver_version(text) == version
