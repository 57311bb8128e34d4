"""Scheduled jobs: specs, the lease lock that makes a double start one run,
the foreground scheduler, and infra/ kept consistent with jobs/."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.jobs import JobLock, JobSpec, load_jobs, render_cronjobs, resolve_args, run_job, schedule

ROOT = Path(__file__).resolve().parents[1]


def _job(tmp_path, name, args, schedule="* * * * *", **extra):
    d = tmp_path / "jobs"
    d.mkdir(exist_ok=True)
    (d / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, "schedule": schedule, "args": args, **extra}))
    return d


def test_every_job_has_its_cronjob_and_the_trainer_is_a_long_lived_deployment():
    from pipeline.jobs import render_services

    jobs = load_jobs()
    assert {"rollout", "admission", "train", "maintenance"} <= set(jobs)
    committed = (ROOT / "infra" / "k8s" / "cronjobs.yaml").read_text()
    assert committed == render_cronjobs(jobs), "infra/k8s/cronjobs.yaml is stale: python -m pipeline.jobs --render-k8s"
    services = (ROOT / "infra" / "k8s" / "services.yaml").read_text()
    assert services == render_services(jobs), "infra/k8s/services.yaml is stale: python -m pipeline.jobs --render-k8s"
    docs = list(yaml.safe_load_all(committed))
    by_job = {d["metadata"]["labels"]["job"]: d for d in docs}
    # the trainer: one resident process for every version, not a Job per version
    assert jobs["train"].service and jobs["train"].args == ("train", "--follow") and "train" not in by_job
    deploy = {d["metadata"]["labels"]["service"]: d for d in yaml.safe_load_all(services)}["train"]
    assert deploy["kind"] == "Deployment" and deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"]["type"] == "Recreate"          # never two trainers of one line at once
    pod = deploy["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"] == ["train", "--follow"]
    assert pod["terminationGracePeriodSeconds"] == jobs["train"].grace_s >= 600   # SIGTERM finishes a version
    assert pod["initContainers"][0]["args"] == ["policy", "init", "--if-missing"]
    for name, spec in jobs.items():
        if spec.service:
            continue
        assert by_job[name]["spec"]["schedule"] == spec.schedule
        args = by_job[name]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args == ["jobs", "run", name]


def test_compose_has_object_storage_dask_the_scheduler_and_the_resident_trainer():
    compose = yaml.safe_load((ROOT / "infra" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"minio", "dask-scheduler", "dask-worker", "scheduler", "trainer"} <= set(services)
    assert services["scheduler"]["command"] == ["jobs", "schedule"]
    trainer = services["trainer"]
    assert trainer["entrypoint"][-1].endswith("exec pipeline train --follow")
    assert trainer["restart"] == "unless-stopped" and trainer["stop_grace_period"] == "1h"
    assert trainer["environment"]["PIPELINE_LAKE"] == services["scheduler"]["environment"]["PIPELINE_LAKE"]


def test_a_service_is_not_scheduled_nor_run_as_a_job(lake, tmp_path):
    from pipeline.errors import ConfigError

    d = tmp_path / "jobs"
    d.mkdir()
    (d / "svc.yaml").write_text(yaml.safe_dump({"name": "svc", "args": ["train", "--follow"], "service": True}))
    spec = load_jobs(d)["svc"]
    assert spec.service and spec.schedule == ""
    res = run_job(lake, spec)
    assert res["status"] == "skipped" and "is a service" in res["reason"]
    from pipeline.errors import NotFoundError

    with pytest.raises(NotFoundError, match="no jobs to schedule"):
        schedule(lake, {"svc": spec}, for_seconds=0.1)
    (d / "svc.yaml").write_text(yaml.safe_dump({"name": "svc", "args": ["x"], "service": True, "schedule": "* * * * *"}))
    with pytest.raises(ConfigError, match="has no schedule"):
        load_jobs(d)


def test_bad_job_spec_is_a_clear_error(tmp_path):
    from pipeline.errors import ConfigError

    d = _job(tmp_path, "x", ["sql", "SELECT 1"], schedule="every minute")
    with pytest.raises(ConfigError, match="not a valid cron"):
        load_jobs(d)


def test_lock_is_exclusive_and_an_expired_lease_is_taken_over(lake):
    a = JobLock(lake, "j", lease_s=60)
    assert a.acquire()
    assert not JobLock(lake, "j", lease_s=60).acquire()
    a.release()
    stale = JobLock(lake, "j", lease_s=-1)  # a holder that died: its lease is already over
    assert stale.acquire()
    assert JobLock(lake, "j", lease_s=60).acquire()


def test_double_start_yields_one_run(lake, tmp_path):
    slow = "SELECT count(*) AS n FROM range(1000000000) t(i) WHERE i % 7 = 3"
    d = _job(tmp_path, "slow", ["sql", slow, "--json"])
    first = subprocess.Popen([sys.executable, "-m", "pipeline", "jobs", "run", "slow", "--jobs-dir", str(d),
                              "--lake", lake.uri, "--json"], stdout=subprocess.PIPE, text=True)
    from pipeline.lake.lease import holder

    for _ in range(600):
        if holder(lake, "job-slow") is not None or first.poll() is not None:
            break
        time.sleep(0.05)
    second = run_job(lake, load_jobs(d)["slow"])
    out, _ = first.communicate(timeout=600)
    assert second["status"] == "skipped", second
    assert "held by pipeline jobs run slow" in second["reason"], second
    assert json.loads(out)["status"] == "ok"
    assert holder(lake, "job-slow") is None, "the lease is released after the run"


def test_slot_and_next_snapshot_tokens(lake):
    spec = JobSpec(name="t", schedule="* * * * *", args=("rollout", "--seed", "{slot}"))
    assert resolve_args(lake, spec, now=120.0) == ["rollout", "--seed", "2"]
    train = JobSpec(name="train", schedule="* * * * *", args=("train", "--batch-snapshot", "{next_snapshot}"))
    assert resolve_args(lake, train) is None  # nothing admitted yet: nothing to do
    assert run_job(lake, train)["status"] == "nothing_to_do"


def test_schedule_runs_jobs_on_their_cron(lake, tmp_path):
    d = _job(tmp_path, "tick", ["sql", "SELECT 1 AS one"], schedule="* * * * * */1")  # every second
    seen: list[dict] = []

    def stop_after_two(res):   # Ctrl-C once two runs have finished: a run's length is the machine's, not the test's
        seen.append(res)
        if len(seen) == 2:   # once: a run still going then is waited for and reported after the stop
            raise KeyboardInterrupt

    results = schedule(lake, load_jobs(d), for_seconds=300, on_result=stop_after_two)
    assert len(results) >= 2 and all(r["status"] == "ok" for r in results), results


def test_breaking_an_expired_lease_never_deletes_a_fresh_one(lake):
    """Two starters both saw the old lease expired: the one that takes it over
    holds the job; the late one finds the fresh lease and backs off, and the
    fresh lease is still there (tests/test_leases.py races many at once)."""
    from pipeline.lake.lease import holder

    dead = JobLock(lake, "k", lease_s=-1)
    assert dead.acquire()                    # a holder that died: its lease is over
    first, late = JobLock(lake, "k", lease_s=60), JobLock(lake, "k", lease_s=60)
    assert first.acquire()                   # takes the expired lease over
    assert not late.acquire()                # finds that fresh lease and backs off
    assert late.held_by["owner"] == first.lease.owner
    held = holder(lake, "job-k")
    assert held["expires"] > time.time() and held["generation"] == first.lease.generation
    dead.release()                           # the dead holder's late release must not free it
    assert holder(lake, "job-k")["generation"] == first.lease.generation


def test_a_lock_created_but_never_written_expires_by_age(lake):
    import os

    lock = Path(lake.uri) / "_locks" / "job-e"
    lock.parent.mkdir(parents=True)
    lock.write_bytes(b"")
    old = time.time() - 120
    os.utime(lock, (old, old))
    assert JobLock(lake, "e", lease_s=60).acquire()


def test_admission_job_runs_on_the_dask_cluster_infra_starts():
    """compose and Kubernetes start a scheduler and workers, point admission at
    it with PIPELINE_DASK_SCHEDULER, and give workers no lake credentials (the
    driver sends the lake's storage options); the admission job's engine is
    auto, so that variable selects Dask (tests/admission/test_dask_cluster.py runs it)."""
    compose = yaml.safe_load((ROOT / "infra" / "compose.yaml").read_text())["services"]
    addr = compose["scheduler"]["environment"]["PIPELINE_DASK_SCHEDULER"]
    assert addr == "tcp://dask-scheduler:8786"
    assert compose["dask-scheduler"]["entrypoint"][:2] == ["dask", "scheduler"]
    assert compose["dask-worker"]["entrypoint"][:3] == ["dask", "worker", addr]
    assert not [k for k in compose["dask-worker"].get("environment") or {} if k.startswith("AWS_")]
    cm = yaml.safe_load((ROOT / "infra" / "k8s" / "configmap.yaml").read_text())["data"]
    assert cm["PIPELINE_DASK_SCHEDULER"] == addr
    docs = {(d["kind"], d["metadata"]["name"]): d
            for d in yaml.safe_load_all((ROOT / "infra" / "k8s" / "dask.yaml").read_text())}
    svc = docs[("Service", "dask-scheduler")]
    assert 8786 in [p["port"] for p in svc["spec"]["ports"]]
    sched = docs[("Deployment", "dask-scheduler")]["spec"]["template"]["spec"]["containers"][0]
    assert sched["command"][:2] == ["dask", "scheduler"]
    worker = docs[("Deployment", "dask-worker")]["spec"]["template"]["spec"]["containers"][0]
    assert worker["command"][:3] == ["dask", "worker", addr]
    assert "admit" in load_jobs()["admission"].args and "--engine" not in load_jobs()["admission"].args

    from pipeline.commands.admit import resolve_engine

    assert resolve_engine("auto", addr) == ("dask", addr)
    assert resolve_engine("auto", None)[0] in ("duckdb", "dask")  # dask only if the env names a cluster
