"""A real distributed cluster for tests: ``dask scheduler`` and ``dask worker``
processes (not a LocalCluster in the test process), started with an
environment that has no AWS_* variables, so workers see only what the driver
sends them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


class Cluster:
    def __init__(self, tmp: Path, n_workers: int = 2, env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | (env or {})
        self.env["DASK_DISTRIBUTED__WORKER__DAEMON"] = "False"
        self.file = tmp / "scheduler.json"
        self.scheduler = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_scheduler", "--scheduler-file", str(self.file),
             "--host", "127.0.0.1", "--port", "0", "--no-dashboard"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=open(tmp / "scheduler.log", "w"))
        deadline = time.time() + 120
        while not self.file.exists() or not self.file.read_text().strip():
            if time.time() > deadline or self.scheduler.poll() is not None:
                raise RuntimeError("dask scheduler did not start: " + (tmp / "scheduler.log").read_text()[-2000:])
            time.sleep(0.1)
        self.address = json.loads(self.file.read_text())["address"]
        self.workers = [self.add_worker(i) for i in range(n_workers)]
        if n_workers:
            self.wait_for(n_workers)

    def add_worker(self, i: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", self.address, "--nthreads", "1",
             "--no-nanny", "--no-dashboard", "--name", f"w{i}-{time.time_ns()}"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=open(self.tmp / f"worker-{i}.log", "a"))

    def wait_for(self, n: int) -> None:
        from distributed import Client

        with Client(self.address, timeout=60) as c:
            c.wait_for_workers(n, timeout=120)

    def kill_workers(self) -> None:
        for w in self.workers:
            w.kill()
            w.wait(timeout=30)

    def close(self) -> None:
        for p in [*self.workers, self.scheduler]:  # nothing to keep: no graceful (reconnecting) shutdown
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
