"""The stack both bench/overload/ and bench/soak/ drive: a real router in front of a real prefill and
decode (``stage serve``, KV over ``--transfer``) on free loopback ports, each in its own process with
its log in ``log_dir``, started together and stopped together."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.common.children import Child, Server, server_env
from process.ports import free_port

ROLES = ("router", "prefill", "decode")


def add_stack_args(p: argparse.ArgumentParser, max_num_seqs: int, max_waiting: int, router_in_flight: int) -> None:
    """The stack's flags: --transfer, the stages' --max-num-seqs / --max-waiting (past them a stage
    answers 503 with Retry-After) and the router's --max-in-flight (past it the router does)."""
    p.add_argument("--transfer", default="mooncake", help="KV transfer between the prefill and the decode")
    p.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help="the stages' --max-num-seqs")
    p.add_argument("--max-waiting", type=int, default=max_waiting, help="the stages' --max-waiting")
    p.add_argument("--router-max-in-flight", type=int, default=router_in_flight, help="the router's --max-in-flight")


@dataclass
class PdStack:
    """A started, healthy PD stack: ``url`` is the router's; ``children`` by role (``ROLES``)."""

    children: dict[str, Child]

    @property
    def url(self) -> str:
        return self.children["router"].url

    def pids(self) -> dict[str, int]:
        """{role: pid} of every process of the stack."""
        return {role: child.proc.pid for role, child in self.children.items()}

    def stop(self) -> None:
        """SIGTERM every process (the router first), SIGKILL after 10 s."""
        for role in ROLES:
            if role in self.children:
                self.children[role].stop()


def start_pd_stack(args: argparse.Namespace, model: Path, log_dir: Path) -> PdStack:
    """The prefill and decode (``args.threads`` torch threads, ``args.max_num_seqs``/``max_waiting``,
    ``args.server_arg``), then the router in front of them, all healthy within ``args.startup_timeout``
    seconds each; on any failure everything started is stopped and the error (naming the child, with
    its log's tail) raised."""
    log_dir.mkdir(parents=True, exist_ok=True)
    limits = ["--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting),
              "--transfer", args.transfer, *args.server_arg]
    children: dict[str, Child] = {}
    stack = PdStack(children)
    try:
        children["prefill"] = Server("prefill", model, [], args.threads, log_dir / "prefill.log",
                                     [*limits, "--bootstrap-port", str(free_port())])
        children["decode"] = Server("decode", model, [], args.threads, log_dir / "decode.log", limits)
        for role in ("prefill", "decode"):
            children[role].wait(args.startup_timeout)
        port = free_port()
        argv = [sys.executable, "-m", "cli", "serve", "router", "--host", "127.0.0.1", "--port", str(port),
                "--prefill", children["prefill"].url, "--decode", children["decode"].url,
                "--max-in-flight", str(args.router_max_in_flight), "--log-level", "warning"]
        children["router"] = Child("router", argv, [], log_dir / "router.log", f"http://127.0.0.1:{port}",
                                   server_env(1))
        children["router"].wait(args.startup_timeout)
    except BaseException:
        stack.stop()
        raise
    return stack
