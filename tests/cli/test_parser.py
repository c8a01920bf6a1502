"""The command line's parser (cli/): --help imports no torch, and ``serve`` refuses a bad flag,
naming it, before it loads anything."""

from __future__ import annotations

import pytest


def test_help_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; from cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.unit
@pytest.mark.parametrize("flags, named", [
    (["--max-image-pixels", "0"], "--max-image-pixels"),
    (["--max-images-per-request", "-1"], "--max-images-per-request"),
    (["--block-size", "0"], "--block-size"),
    (["--port", "-5"], "--port"),
    (["--max-body-mb", "0"], "--max-body-mb"),
    (["--max-waiting", "-1"], "--max-waiting"),
    (["--host", "0.0.0.0", "--debug-faults"], "--debug-faults"),
])
def test_serve_refuses_bad_flags_before_loading_anything(flags, named, capsys):
    from cli import main

    assert main(["serve", "colocated", "--model", "/does/not/exist", *flags]) == 2
    assert named in capsys.readouterr().err
