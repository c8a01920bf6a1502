"""A real DNS server for the tests of the router's DNS discovery: Debian's ``dnsmasq`` on 127.0.0.1 at
a free port, answering only from its own records (``--local=/test/``: a name under ``test`` it does
not hold is NXDOMAIN, never forwarded; an address type a name lacks is an empty answer). A and AAAA
records come from a hosts file that ``set_hosts`` rewrites and has re-read (SIGHUP); SRV records are
``--srv-host`` flags, fixed for one process: ``restart`` starts another on the same port with new
ones (the router sees failed answers in between). Every change returns once dnsmasq answers with it,
each wait bounded. A machine without dnsmasq fails the test naming the package to install.

    dns = Dnsmasq.start(tmp_path, hosts={"w.test": ["127.0.0.2"]}, srv=[("_w._tcp.s.test", "a.test", 8000)])
    dns.address                     # "127.0.0.1:PORT", for --discover-nameserver
    dns.set_hosts({"w.test": ["127.0.0.2", "127.0.0.3"]})
    dns.pause(); dns.resume()       # SIGSTOP / SIGCONT: queries time out meanwhile
    dns.stop()
"""

from __future__ import annotations

import getpass
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import dns.exception
import dns.resolver

from process.ports import free_port
from process.children import stop_process

READY_S = 10.0  # a change (or a start) must be visible within this
POLL_S = 0.05
Srv = tuple[str, str, int]  # (SRV name, target, port)


def dnsmasq_binary() -> str:
    """The dnsmasq executable; fails the test naming the package when there is none."""
    found = shutil.which("dnsmasq") or shutil.which("dnsmasq", path="/usr/sbin:/sbin")
    assert found, "dnsmasq is not installed: apt-get install dnsmasq-base (or run scripts/setup.sh test)"
    return found


class Dnsmasq:
    def __init__(self, workdir: Path, port: int, srv: Sequence[Srv]) -> None:
        self.workdir, self.port, self.srv = workdir, port, tuple(srv)
        self.hosts_file = workdir / "hosts"
        self.log_path = workdir / "dnsmasq.log"
        self.proc: subprocess.Popen | None = None
        self._hosts: dict[str, list[str]] = {}

    @classmethod
    def start(cls, workdir: Path, hosts: Mapping[str, list[str]], srv: Sequence[Srv] = ()) -> Dnsmasq:
        """dnsmasq serving ``hosts`` (name -> addresses) and ``srv``, answering them before this returns."""
        workdir.mkdir(parents=True, exist_ok=True)
        for attempt in range(2):  # the free port may be taken before dnsmasq binds it
            server = cls(workdir, free_port(), srv)
            server._write_hosts(hosts)
            try:
                server._launch()
                return server
            except AssertionError:
                server.stop()
                if attempt or "in use" not in server.log():
                    raise
        raise AssertionError("unreachable")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def set_hosts(self, hosts: Mapping[str, list[str]]) -> None:
        """Serve ``hosts`` instead (a name left out becomes NXDOMAIN); returns once dnsmasq answers them."""
        gone = set(self._hosts) - set(hosts)
        self._write_hosts(hosts)
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)
        self._wait_for(dict(hosts), gone)

    def restart(self, srv: Sequence[Srv]) -> None:
        """Stop, and start again on the same port serving ``srv`` (and the same hosts)."""
        self.stop()
        self.srv = tuple(srv)
        self._launch()

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)  # a paused one cannot take SIGTERM
            stop_process(self.proc)
            self.proc = None

    # --- inside --------------------------------------------------------------------------------
    def _write_hosts(self, hosts: Mapping[str, list[str]]) -> None:
        self._hosts = {name: list(addresses) for name, addresses in hosts.items()}
        lines = [f"{address} {name}" for name, addresses in hosts.items() for address in addresses]
        self.hosts_file.write_text("".join(line + "\n" for line in lines))

    def _launch(self) -> None:
        argv = [dnsmasq_binary(), "--no-daemon", "--no-resolv", "--no-hosts", "--local=/test/",
                f"--addn-hosts={self.hosts_file}", "--listen-address=127.0.0.1", "--bind-interfaces",
                f"--port={self.port}", "--pid-file=", f"--user={getpass.getuser()}", "--log-facility=-",
                *(f"--srv-host={name},{target},{port}" for name, target, port in self.srv)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self._wait_for(self._hosts, set())

    def _wait_for(self, hosts: Mapping[str, list[str]], gone: set[str]) -> None:
        """Until every name in ``hosts`` resolves to its addresses, each in ``gone`` is NXDOMAIN, and
        each SRV name has its records (bounded by ``READY_S``; fails with dnsmasq's log)."""
        deadline = time.monotonic() + READY_S
        while not self._answers(hosts, gone):
            assert self.proc is not None
            assert self.proc.poll() is None, f"dnsmasq exited {self.proc.returncode}:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"dnsmasq did not answer within {READY_S} s:\n{self.log()[-3000:]}"
            time.sleep(POLL_S)

    def _answers(self, hosts: Mapping[str, list[str]], gone: set[str]) -> bool:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers, resolver.port = ["127.0.0.1"], self.port
        resolver.timeout = resolver.lifetime = 0.5
        try:
            for name, addresses in hosts.items():
                found = [r.address for rdtype in ("A", "AAAA")
                         for r in resolver.resolve(name, rdtype, raise_on_no_answer=False).rrset or ()]
                if sorted(found) != sorted(addresses):
                    return False
            for name in gone:
                try:
                    resolver.resolve(name, "A")
                    return False
                except dns.resolver.NXDOMAIN:
                    pass
            for name in {name for name, _, _ in self.srv}:
                want = sorted((target, port) for n, target, port in self.srv if n == name)
                found_srv = sorted((r.target.to_text(omit_final_dot=True), r.port) for r in resolver.resolve(name, "SRV"))
                if found_srv != want:
                    return False
        except dns.exception.DNSException:
            return False
        return True
