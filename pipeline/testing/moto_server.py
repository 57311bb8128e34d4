"""A moto S3 server on a free local port, for tests and benchmarks of S3 lakes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request


def start() -> tuple[subprocess.Popen, str]:
    """Start ``python -m moto.server`` on a free port of 127.0.0.1 -> (process, endpoint URL).
    Raises RuntimeError (after killing it) if it does not answer within 20 s."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            return proc, endpoint
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the moto server did not start")


def storage_options(endpoint: str) -> dict[str, str]:
    """The lake storage options for a moto endpoint (moto accepts any credentials)."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
