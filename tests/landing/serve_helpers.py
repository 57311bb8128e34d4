"""Helpers of the front-door tests: ``pipeline serve`` as a subprocess, the
stream's state, raw publishes (imported by the test modules of this directory)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def start_serve(lake_uri: str, url: str, stream: str, *, pause_at: str | None = None, extra: list[str] | None = None,
                env: dict[str, str] | None = None) -> subprocess.Popen:
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    if pause_at:
        e["PIPELINE_TEST_PAUSE_AT"] = pause_at
    else:
        e.pop("PIPELINE_TEST_PAUSE_AT", None)
    return subprocess.Popen([sys.executable, "-m", "pipeline", "serve", "--lake", lake_uri, "--nats", url,
                             "--stream", stream, "--tables", "trajectories", "--interval", "0.2", *(extra or [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e, text=True)


def stop_serve(proc: subprocess.Popen) -> tuple[int, str]:
    if proc.poll() is None:
        proc.terminate()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


def kill9(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.communicate(timeout=30)


def wait_for(pred, *, timeout: float = 60.0, what: str = "condition", proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"pipeline serve exited ({proc.returncode}) while waiting for {what}: "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def stream_messages(url: str, stream: str) -> int:
    """Messages still in the stream (a work queue: every acked message left it)."""
    async def go() -> int:
        import nats

        nc = await nats.connect(url)
        try:
            return (await nc.jetstream().stream_info(stream)).state.messages
        finally:
            await nc.close()
    return asyncio.run(go())


def make_stream(url: str, stream: str, **kw) -> None:
    from pipeline.landing.committer import ServeSettings
    from pipeline.landing.log import ensure_stream

    async def go() -> None:
        import nats

        nc = await nats.connect(url)
        try:
            await ensure_stream(nc.jetstream(), ServeSettings(stream=stream, **kw))
        finally:
            await nc.close()
    asyncio.run(go())


def publish_raw(url: str, stream: str, table: str, payload: bytes, headers: dict[str, str]):
    """One message as another language's producer would send it (no pipeline client)."""
    async def go():
        import nats

        nc = await nats.connect(url)
        try:
            return await nc.jetstream().publish(f"{stream}.{table}", payload, headers=headers, stream=stream)
        finally:
            await nc.close()
    return asyncio.run(go())


def landed_ids(lake) -> list[str]:
    if not lake.exists("trajectories"):
        return []
    return lake.read("trajectories", columns=["trajectory_id"]).column("trajectory_id").to_pylist()
