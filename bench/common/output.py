"""The files a benchmark writes: the indented JSON and the plot (matplotlib imported late: it is the
bench extra)."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: Path, report: dict) -> None:
    """The report, indented, with a final newline; the folder is created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def print_header(header: str) -> None:
    """A table's header line after a blank line, underlined with dashes."""
    print()
    print(header)
    print("-" * len(header))


def pyplot():  # -> the matplotlib.pyplot module
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 120, **savefig_kwargs) -> None:
    """Lay ``fig`` out, write it at ``dpi`` (its folder created) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, **savefig_kwargs)
    pyplot().close(fig)
