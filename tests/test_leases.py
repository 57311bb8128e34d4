"""The lease (pipeline/lake/lease.py, docs/leases.md): exclusive, renewable,
releasable, and when a crashed holder left an expired lease, of many processes
taking it over at the same instant exactly one gets it, on a local lake and on
S3 (a moto server honouring If-None-Match)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.lake.lease import LeaseHeldError, LeaseLostError, acquire, holder, require, try_acquire

RACER = Path(__file__).with_name("lease_racer.py")
RACERS, TRIALS = 8, 5


@pytest.fixture(params=["local", "s3"])
def any_lake(request, lake):
    return lake if request.param == "local" else request.getfixturevalue("s3_lake")


def test_exclusive_renew_release_and_refusal_names_the_owner(any_lake):
    a = acquire(any_lake, "job-x", owner="alice", ttl=60)
    assert a is not None and a.held()
    assert acquire(any_lake, "job-x", owner="bob", ttl=60) is None
    with pytest.raises(LeaseHeldError, match="held by alice"):
        require(any_lake, "job-x", owner="bob", ttl=60)
    assert holder(any_lake, "job-x")["owner"] == "alice"
    before = a.expires
    a.renew()                                   # heartbeat: a newer generation, later expiry
    assert a.generation == 2 and a.expires >= before and a.held()
    assert holder(any_lake, "job-x")["owner"] == "alice"
    assert a.release()
    assert holder(any_lake, "job-x") is None
    b = acquire(any_lake, "job-x", owner="bob", ttl=60)
    assert b is not None and b.generation == 4
    assert not a.release(), "a released lease is not released twice (it is bob's now)"
    with pytest.raises(LeaseLostError):
        a.renew()
    assert holder(any_lake, "job-x")["owner"] == "bob"


def test_expired_lease_is_taken_over_and_the_old_holder_has_lost_it(any_lake):
    dead = acquire(any_lake, "job-y", owner="crashed", ttl=-1)   # its lease is already over
    assert dead is not None and holder(any_lake, "job-y") is None
    new = acquire(any_lake, "job-y", owner="new", ttl=60)
    assert new is not None and new.generation == dead.generation + 1
    assert not dead.held()
    with pytest.raises(LeaseLostError):
        dead.renew()
    assert not dead.release()
    assert holder(any_lake, "job-y")["owner"] == "new"


def test_a_racer_with_an_old_listing_backs_off(lake, monkeypatch):
    """A racer that listed before a newer generation appeared creates a stale,
    lower generation; it must see the newer one and give its own up."""
    import pipeline.lake.lease as L

    acquire(lake, "job-z", owner="crashed", ttl=-1)         # generation 1, expired
    assert acquire(lake, "job-z", owner="winner", ttl=60).generation == 2
    real, first = L._generations, [True]

    def listing(lk, name):  # the slow racer's first listing predates generations 1 and 2
        if first:
            first.pop()
            return []
        return real(lk, name)

    monkeypatch.setattr(L, "_generations", listing)
    lease, held = try_acquire(lake, "job-z", owner="slow", ttl=60)
    assert lease is None and held["owner"] == "winner"
    assert holder(lake, "job-z")["owner"] == "winner"
    assert [n for n in (Path(lake.uri) / "_locks" / "job-z").iterdir()] == \
        [Path(lake.uri) / "_locks" / "job-z" / f"lease.{2:020d}"], "the slow racer's generation 1 is removed"


def test_legacy_single_file_lease_still_guards_and_expires(lake):
    import os

    p = Path(lake.uri) / "_locks" / "job-old"
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"host": "h", "pid": 1, "expires": time.time() + 60, "job": "old"}))
    assert acquire(lake, "job-old", ttl=60) is None                 # a live lease of the old format
    p.write_bytes(b"")                                            # created but never written, long ago
    old = time.time() - 120
    os.utime(p, (old, old))
    assert acquire(lake, "job-old", ttl=60) is not None


def _race(lake, tmp_path, trials: int) -> list[list[dict]]:
    """RACERS processes take over an expired lease at one instant, ``trials`` times."""
    for t in range(trials):
        assert acquire(lake, f"race-{t}", owner="crashed-holder", ttl=-1) is not None  # left expired
    sync = tmp_path / "sync"
    sync.mkdir()
    opts = json.dumps(lake.storage_options or {})
    procs = [subprocess.Popen([sys.executable, str(RACER), lake.uri, opts, str(sync), str(i), str(trials)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(RACERS)]
    try:
        for t in range(trials):
            deadline = time.time() + 300
            while len(list(sync.glob(f"ready-{t}-*"))) < RACERS:
                assert time.time() < deadline, "racers did not get ready"
                assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
                time.sleep(0.01)
            (sync / f"go-{t}").write_text("")
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    rows = [json.loads(line) for o in outs for line in o[0].splitlines()]
    return [[r for r in rows if r["trial"] == t] for t in range(trials)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_simultaneous_takeover_of_an_expired_lease_has_exactly_one_winner(kind, lake, tmp_path, request):
    lk = lake if kind == "local" else request.getfixturevalue("s3_lake")
    for t, rows in enumerate(_race(lk, tmp_path, TRIALS)):
        assert len(rows) == RACERS
        winners = [r for r in rows if r["got"]]
        assert len(winners) == 1, f"trial {t}: {len(winners)} holders: {rows}"
        win = winners[0]
        assert win["generation"] == 2
        assert holder(lk, f"race-{t}")["owner"] == f"racer-{win['racer']}"
        assert {r["holder"] for r in rows if not r["got"]} == {f"racer-{win['racer']}"}, \
            "every refusal names the live owner"


def test_a_retried_put_that_had_landed_is_still_ours(any_lake, monkeypatch):
    """A PUT retried after an ambiguous failure is refused (412) although its
    first attempt created the object: the lease compares tokens, not outcomes."""
    import pipeline.lake.lease as L

    real = L.objects.put_if_absent

    def landed_but_refused(lake, rel, data):
        real(lake, rel, data)
        return False

    monkeypatch.setattr(L.objects, "put_if_absent", landed_but_refused)
    lease = acquire(any_lake, "job-r", owner="me", ttl=60)
    assert lease is not None and holder(any_lake, "job-r")["owner"] == "me"
    lease.renew()
    assert lease.held()
    assert lease.release() and holder(any_lake, "job-r") is None
