"""docs/multihost.md stays true: its table of deadlines and intervals is the one generated from the
parsers of ``stage serve ROLE --help`` (every flag in seconds, its default and help, per role), so a
changed default, a new deadline flag or a reworded help fails here until the doc is regenerated:

    .venv/bin/python -m tests.test_multihost_doc > /tmp/table.md   # then paste it between the markers

and every flag the doc names exists on the role it names it for."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from cli import build_parser

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[1] / "docs" / "multihost.md"
BEGIN = "<!-- deadlines: generated from `stage serve ROLE --help` (tests/test_multihost_doc.py) -->"
END = "<!-- end of generated deadlines -->"
ROLES = ("router", "encoder", "prefill", "decode", "pd", "colocated")
NOT_DEADLINES = {"--cache-ttl-s", "--ratio-window-s", "--auto-ratio-interval-s"}  # lifetimes and windows


def role_parsers() -> dict[str, argparse.ArgumentParser]:
    """``stage serve ROLE``'s parser for every role, the router's included."""
    serve = _subparsers(build_parser())["serve"]
    return {role: parser for role, parser in _subparsers(serve).items() if role in ROLES}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def deadline_rows() -> list[tuple[str, str, str, str]]:
    """(flag, roles, default, help) for every flag in seconds of every role, one row per flag and
    (default, help), in ``ROLES`` order of first appearance."""
    rows: dict[tuple[str, str, str], list[str]] = {}
    parsers = role_parsers()
    for role in ROLES:
        for action in parsers[role]._actions:
            flag = next((o for o in action.option_strings if o.startswith("--")), None)
            if flag is None or not flag.endswith("-s") or flag in NOT_DEADLINES:
                continue
            help_text = " ".join((action.help or "").split()).replace("|", "\\|")
            rows.setdefault((flag, f"{action.default:g}", help_text), []).append(role)
    return [(flag, ", ".join(roles), default, text) for (flag, default, text), roles in rows.items()]


def render() -> str:
    lines = [BEGIN, "| flag | roles | default (s) | what it bounds (the flag's help) |", "|---|---|---|---|"]
    lines += [f"| `{flag}` | {roles} | {default} | {text} |" for flag, roles, default, text in deadline_rows()]
    return "\n".join([*lines, END])


def test_the_deadline_table_is_the_generated_one():
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC} lacks the generated table's markers"
    table = text[text.index(BEGIN):text.index(END) + len(END)]
    assert table == render(), "docs/multihost.md's deadline table is stale: regenerate it (python -m tests.test_multihost_doc)"


def test_every_flag_the_doc_names_exists():
    parsers = role_parsers()
    known = {o for p in parsers.values() for a in p._actions for o in a.option_strings}
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", DOC.read_text()))
    assert sorted(named - known) == []


if __name__ == "__main__":
    print(render())
