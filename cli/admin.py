"""``stage admin``: the router's admin API from an operator's terminal (docs/admin.md). Standard
library only (urllib), so it starts at once; a readable table, or the API's JSON with ``--json``.

    stage admin workers                       [--router URL] [--token T] [--json]
    stage admin add URL --role ROLE [--group LABEL]
    stage admin drain ID [--wait-s S]         stage admin resume ID
    stage admin remove ID [--force]
    stage admin pairing [--by any|group|transfer] [--link LABEL=LABEL,LABEL ...]
    stage admin ratio [--window-s S] [--apply [ENCODER:]PREFILL:DECODE]
    stage admin role ID ROLE                  switch one switchable worker to ROLE
    stage admin room ROOM | --slowest N

The token is ``--token`` or ``EPD_ADMIN_TOKEN``. Exit status: 0 on success, 1 when the router
refused or failed (its error message on stderr), 2 on a bad command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from process.secrets import TOKEN_ENV

Column = tuple[str, Callable[[dict], object]]
FIXES = {401: f" (give the router's admin token with --token or the {TOKEN_ENV} environment variable)"}


def add_admin_args(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--router", default="http://127.0.0.1:8080", help="the router's URL")
    common.add_argument("--token", default=None, help=f"admin token (default: the {TOKEN_ENV} environment variable)")
    common.add_argument("--json", action="store_true", help="print the API's JSON answer")
    commands = parser.add_subparsers(dest="admin_command", required=True)
    commands.add_parser("workers", parents=[common], help="list the workers")
    add = commands.add_parser("add", parents=[common], help="add a worker (its /server_info is checked)")
    add.add_argument("url")
    add.add_argument("--role", required=True, choices=["encoder", "prefill", "decode", "colocated"])
    add.add_argument("--group", default=None, help="pairing label (default: the stage's --group)")
    drain = commands.add_parser("drain", parents=[common], help="stop new work to a worker, wait until idle")
    drain.add_argument("id")
    drain.add_argument("--wait-s", type=float, default=None, help="wait this long (default: the router's "
                       "--drain-timeout-s); 0: do not wait")
    resume = commands.add_parser("resume", parents=[common], help="a drained worker takes new work again")
    resume.add_argument("id")
    remove = commands.add_parser("remove", parents=[common], help="remove a worker (refused while busy)")
    remove.add_argument("id")
    remove.add_argument("--force", action="store_true", help="remove it even with requests in flight")
    pairing = commands.add_parser("pairing", parents=[common], help="show or set the pairing rules")
    pairing.add_argument("--by", choices=["any", "group", "transfer"], default=None, help="set the rules")
    pairing.add_argument("--link", action="append", default=[], metavar="LABEL=LABEL,LABEL",
                         help="with --by: prefills of LABEL feed decodes of these labels (repeatable)")
    ratio = commands.add_parser("ratio", parents=[common], help="load, capacity and the recommended split")
    ratio.add_argument("--window-s", type=float, default=None, help="measure over this window (at most the "
                       "router's --ratio-window-s)")
    ratio.add_argument("--apply", default=None, metavar="[ENCODER:]PREFILL:DECODE",
                       help="switch workers to this split (E:P:D in epd mode moves encoders too)")
    role = commands.add_parser("role", parents=[common], help="switch one switchable worker to another role")
    role.add_argument("id")
    role.add_argument("role", choices=["encoder", "prefill", "decode"])
    room = commands.add_parser("room", parents=[common], help="one room's timeline, or the slowest rooms")
    room.add_argument("room", nargs="?", type=int)
    room.add_argument("--slowest", type=int, default=None, help="list the N slowest recent rooms")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get(TOKEN_ENV)
    try:
        method, path, body = _request(args)
    except ValueError as exc:
        print(f"stage admin: error: {exc}", file=sys.stderr)
        return 2
    try:
        status, answer = call(args.router.rstrip("/"), method, path, body, token)
    except OSError as exc:
        print(f"stage admin: cannot reach {args.router}: {exc}", file=sys.stderr)
        return 1
    if status >= 400:
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message") if isinstance(error, dict) else answer
        print(f"stage admin: HTTP {status}: {message}{FIXES.get(status, '')}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
    elif isinstance(answer, dict):
        print(render(args, answer))
    else:
        print(f"stage admin: HTTP {status}: the answer is not a JSON object: {str(answer)[:200]!r}", file=sys.stderr)
        return 1
    return 0


def _request(args: argparse.Namespace) -> tuple[str, str, dict | None]:
    command = args.admin_command
    if command == "workers":
        return "GET", "/admin/workers", None
    if command == "add":
        return "POST", "/admin/workers", {"url": args.url, "role": args.role,
                                          **({"group": args.group} if args.group else {})}
    if command == "drain":
        wait = "" if args.wait_s is None else f"?wait_s={args.wait_s}"
        return "POST", f"/admin/workers/{args.id}/drain{wait}", None
    if command == "resume":
        return "POST", f"/admin/workers/{args.id}/resume", None
    if command == "remove":
        return "DELETE", f"/admin/workers/{args.id}" + ("?force=true" if args.force else ""), None
    if command == "pairing":
        if args.by is None:
            if args.link:
                raise ValueError("--link needs --by")
            return "GET", "/admin/pairing", None
        return "PUT", "/admin/pairing", {"by": args.by, "links": dict(_link(text) for text in args.link)}
    if command == "ratio":
        if args.apply is None:
            return "GET", "/admin/ratio" + ("" if args.window_s is None else f"?window_s={args.window_s}"), None
        return "POST", "/admin/ratio", _split(args.apply)
    if command == "role":
        return "POST", f"/admin/workers/{args.id}/role", {"role": args.role}
    if (args.room is None) == (args.slowest is None):
        raise ValueError("room takes a room id or --slowest N")
    return "GET", f"/admin/rooms/{args.room}" if args.room is not None else f"/admin/rooms?slowest={args.slowest}", None


def _split(text: str) -> dict[str, int]:
    """``--apply``'s ``P:D`` or ``E:P:D`` as ``POST /admin/ratio``'s body."""
    counts = text.split(":")
    if len(counts) not in (2, 3) or not all(n.isascii() and n.isdigit() for n in counts):
        raise ValueError(f"--apply takes PREFILL:DECODE or ENCODER:PREFILL:DECODE, e.g. 3:5 or 2:3:3, got {text!r}")
    return dict(zip(("encoder", "prefill", "decode")[3 - len(counts):], map(int, counts)))


def _link(text: str) -> tuple[str, list[str]]:
    source, sep, targets = text.partition("=")
    if not sep or not source:
        raise ValueError(f"--link takes LABEL=LABEL,LABEL, got {text!r}")
    return source, [t for t in targets.split(",") if t]


def call(base: str, method: str, path: str, body: dict | None, token: str | None) -> tuple[int, object]:
    """(HTTP status, the decoded JSON answer). Raises OSError if the router cannot be reached."""
    request = urllib.request.Request(base + path, method=method, data=None if body is None else
                                     json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


# --- tables ------------------------------------------------------------------------------------
def render(args: argparse.Namespace, answer: dict) -> str:
    command = args.admin_command
    if command == "workers":
        return table(answer["workers"], WORKER_COLUMNS)
    if command == "add":
        dial = [f"  dial {pair}: {said}" for pair, said in answer["dial"].items()]
        return "\n".join([table([answer["worker"]], WORKER_COLUMNS[:3] + WORKER_COLUMNS[8:]), *dial])
    if command in ("drain", "resume", "remove"):
        worker = answer.get("worker") or answer["removed"]
        state = {"drain": "idle" if answer.get("idle") else f"draining, {worker['outstanding']} request(s) in flight",
                 "resume": "taking new work", "remove": "removed"}[command]
        return f"{worker['id']} ({worker['role']} {worker['url']}): {state}"
    if command == "pairing":
        return f"rules: {answer['describe']}; {answer['allowed_pairs']} pair(s) allowed\n" + table(
            answer["pairs"], [("PREFILL", lambda p: p["prefill"]), ("DECODE", lambda p: p["decode"]),
                              ("ALLOWED", lambda p: "yes" if p["allowed"] else "no"),
                              ("WHY NOT", lambda p: p["why_not"] or "")])
    if command == "ratio":
        return _ratio(answer) if "roles" in answer else _applied(answer)
    if command == "role":
        worker, switched = answer["worker"], answer["switched"]
        done = (f"switched from {switched['from']} in {switched['seconds']:.2f} s" if switched
                else "serves that role already")
        return f"{worker['id']} ({worker['role']} {worker['url']}): {done}"
    return _room(answer) if "timeline" in answer else table(answer["rooms"], ROOM_COLUMNS)


def table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    cells = [[header for header, _ in columns]] + [[_cell(get(row)) for _, get in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip() for line in cells)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


WORKER_COLUMNS: list[Column] = [
    ("ID", lambda w: w["id"]), ("ROLE", lambda w: w["role"]), ("URL", lambda w: w["url"]),
    ("HEALTH", lambda w: "ok" if w["healthy"] else "down"), ("CIRCUIT", lambda w: w["circuit"]),
    ("OUT", lambda w: w["outstanding"]), ("QUEUE", lambda w: w.get("queue_depth")),
    ("KV", lambda w: w.get("kv_blocks_used")), ("GROUP", lambda w: w["group"]),
    ("DRAINING", lambda w: "yes" if w["draining"] else ""), ("SWITCHABLE", lambda w: "yes" if w["switchable"] else ""),
]
ROOM_COLUMNS: list[Column] = [
    ("ROOM", lambda r: r["room"]), ("SECONDS", lambda r: r["seconds"]), ("OUTCOME", lambda r: r["outcome"]),
    # epd: the encoders the room's images went to (keyed encoder, encoder2, ...); none: cached, or no image
    ("ENCODER", lambda r: ",".join(w["id"] for stage, w in r["workers"].items() if stage.startswith("encoder"))
     or None),
    ("PREFILL", lambda r: (r["workers"].get("prefill") or {}).get("id")),
    ("DECODE", lambda r: (r["workers"].get("decode") or {}).get("id")),
]


def _ratio(answer: dict) -> str:
    roles = [{"role": role, **load} for role, load in answer["roles"].items()]
    demand = answer["demand"]
    split = (lambda s: ":".join(str(v) for v in s.values()) if s else "-")
    lines = [
        f"measured over {answer['measured_s']:.1f} s (window {answer['window_s']:g} s)",
        table(roles, [("ROLE", lambda r: r["role"]), ("WORKERS", lambda r: r["workers"]),
                      ("SWITCHABLE", lambda r: r["switchable"]), ("UTILIZATION", lambda r: r["utilization"]),
                      ("QUEUE", lambda r: r["queue_depth"]), ("DEMAND/S", lambda r: r["demand_per_s"]),
                      ("CAPACITY/BUSY-S", lambda r: r["capacity_per_busy_s"])]),
        f"demand: {demand['images_per_s']:.3g} images/s, {demand['prefill_tokens_per_s']:.3g} prefill tokens/s, "
        f"{demand['decode_tokens_per_s']:.3g} decode tokens/s; TTFT {_cell(answer['ttft_s'])} s, "
        f"TPOT {_cell(answer['tpot_s'])} s",
        f"split ({'/'.join(answer['current'])}): now {split(answer['current'])}, recommended "
        f"{split(answer['recommended'])}{' (' + answer['reason'] + ')' if answer.get('reason') else ''}, "
        f"{'/'.join(answer['apply'] or ('prefill', 'decode'))} to apply {split(answer['apply'])}",
    ]
    return "\n".join(lines)


def _applied(answer: dict) -> str:
    """``POST /admin/ratio``'s answer: the split now and each switch made."""
    roles = [role for role in ("encoder", "prefill", "decode") if role in answer]
    head = f"{'/'.join(roles)} now {':'.join(str(answer[role]) for role in roles)}"
    return "\n".join([head, *(f"  {s['id']}: {s['from']} -> {s['to']} in {s['seconds']:.2f} s"
                               for s in answer["switched"])])


def _room(answer: dict) -> str:
    start = answer["timeline"][0]["t"] if answer["timeline"] else 0.0
    head = f"room {answer['room']}: {answer['outcome']}, {_cell(answer['seconds'])} s"
    missing = [f"  {stage}: {info['error']}" for stage, info in answer["stages"].items() if "error" in info]
    rows = [{"ms": f"{(e['t'] - start) * 1000:.1f}", **e} for e in answer["timeline"]]
    details = (lambda e: " ".join(f"{k}={_cell(v)}" for k, v in e.items() if k not in ("ms", "stage", "event", "t")))
    return "\n".join([head, *missing, table(rows, [("+MS", lambda e: e["ms"]), ("STAGE", lambda e: e["stage"]),
                                                    ("EVENT", lambda e: e["event"]), ("DETAILS", details)])])
