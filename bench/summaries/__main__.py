"""``python -m bench.summaries --write-readme | --check``: bench/README.md's "Latest figures" table
from the summaries in this folder (exit 1 from --check when they disagree or a summary is invalid)."""

from __future__ import annotations

import argparse
import sys

from bench.common.record import problems, summary_name
from bench.summaries import FOLDER, README, load, render, splice


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.summaries", description=__doc__.split("\n\n")[0])
    action = p.add_mutually_exclusive_group(required=True)
    action.add_argument("--write-readme", action="store_true", help="rewrite the table in bench/README.md")
    action.add_argument("--check", action="store_true", help="exit 1 if the table is not the summaries'")
    args = p.parse_args(argv)
    summaries = load()
    wrong = [f"{s.get('benchmark')}/{s.get('configuration')}: {line}" for s in summaries for line in problems(s)]
    wrong += [f"{name}: should be named {summary_name(s['benchmark'], s['configuration'])}"
              for name, s in zip(sorted(p.name for p in FOLDER.glob("*.json")), summaries)
              if not problems(s) and name != summary_name(s["benchmark"], s["configuration"])]
    if wrong:
        print("invalid summaries:\n  " + "\n  ".join(wrong), file=sys.stderr)
        return 1
    text = README.read_text()
    wanted = splice(text, render(summaries))
    if args.check:
        if wanted != text:
            print(f"{README} is out of date: run python -m bench.summaries --write-readme", file=sys.stderr)
            return 1
        print(f"{README}: the table matches {len(summaries)} summaries")
        return 0
    README.write_text(wanted)
    print(f"wrote the table of {len(summaries)} summaries into {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
