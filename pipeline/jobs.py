"""Scheduled jobs: one YAML file per job in jobs/ (what, when, with which args).

    name: admission
    description: decide complete groups and materialize a snapshot
    schedule: "*/5 * * * *"        # cron; a 6th field = seconds
    args: [admit, --json]          # a `pipeline` command line (--lake is added)
    timeout_s: 1800
    before: [[policy, init, --if-missing]]   # optional: command lines run first (bootstrap), each must succeed

`pipeline jobs run NAME` runs one job once under a lease in the lake
(pipeline/lake/lease.py, name ``job-NAME`` under ``<lake>/_locks/``: generation
objects created with an exclusive create, a hard link on a local lake, a
conditional PUT (If-None-Match) on S3; docs/leases.md), so a double start — a
Kubernetes CronJob may start a job twice — yields one run, and of any number
of starters racing to take over an expired lease exactly one wins; the others
report ``skipped: already running (lease 'job-NAME' is held by ...)``. The jobs themselves are
idempotent too (admission never decides a group twice, training refuses a
consumed snapshot), so a start after the lease expired is still safe.
`pipeline jobs schedule` runs every job on its schedule in the foreground.

A *service* (``service: true``, no schedule) is a long-lived process, not a job
per run: the resident trainer (``jobs/train.yaml``: ``pipeline train --follow``).
It renders as a Kubernetes Deployment (one replica, ``Recreate``: never two at
once; ``grace_s`` = terminationGracePeriodSeconds, the time SIGTERM gives it to
finish a version and write its full state; its ``before`` steps run as an
init container) into ``infra/k8s/services.yaml``; compose runs it as a service;
the scheduler and ``jobs run`` leave it alone.

The token ``{slot}`` in args becomes the minute of the run (a fresh rollout
seed per scheduled run); ``{next_snapshot}`` resolves to the oldest snapshot that no
published checkpoint has trained on; with none, the job does nothing.
``{dynamic_groups:DEFAULT:MAX}`` is dynamic sampling as a loop: the group count
the newest admission's ``--target-groups`` report asks for
(pipeline.admission.run.plan_next_rollout: the shortfall over the observed
admit rate, clamped to MAX), DEFAULT when no admission recorded a target.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import lineage
from pipeline.errors import ConfigError, NotFoundError, PipelineError
from pipeline.resources import resource_dir

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake
    from pipeline.lake.lease import Lease


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    name: str
    schedule: str
    args: tuple[str, ...]
    description: str = ""
    timeout_s: int = 3600
    lease_s: int | None = None     # lock lease; defaults to timeout_s
    resources: dict[str, Any] = field(default_factory=dict)  # for infra rendering (cpu, memory)
    before: tuple[tuple[str, ...], ...] = ()   # command lines run first, e.g. the policy bootstrap
    service: bool = False          # long-lived (a Deployment), not scheduled
    grace_s: int = 600             # service: seconds between SIGTERM and SIGKILL

    @property
    def lease(self) -> int:
        return self.lease_s or self.timeout_s


def load_jobs(jobs_dir: str | Path | None = None) -> dict[str, JobSpec]:
    import yaml
    from croniter import croniter

    d = Path(jobs_dir) if jobs_dir else resource_dir("jobs")
    out = {}
    for f in sorted(d.glob("*.yaml")):
        raw = yaml.safe_load(f.read_text()) or {}
        service = bool(raw.get("service", False))
        missing = ({"name", "args"} if service else {"name", "schedule", "args"}) - set(raw)
        if missing:
            raise ConfigError(f"{f}: missing key(s) {sorted(missing)}")
        if raw["name"] != f.stem:
            raise ConfigError(f"{f}: name {raw['name']!r} must equal the file name {f.stem!r}")
        if service and raw.get("schedule"):
            raise ConfigError(f"{f}: a service runs until stopped and has no schedule",
                              hint="drop `schedule`, or `service: true` for a scheduled job")
        if not service and not croniter.is_valid(raw["schedule"]):
            raise ConfigError(f"{f}: schedule {raw['schedule']!r} is not a valid cron expression")
        before = raw.get("before") or []
        if not isinstance(before, list) or not all(isinstance(b, list) and b for b in before):
            raise ConfigError(f"{f}: before must be a list of command lines (lists of arguments)",
                              hint="e.g. before: [[policy, init, --if-missing]]")
        out[raw["name"]] = JobSpec(name=raw["name"], schedule=raw.get("schedule", ""),
                                   args=tuple(map(str, raw["args"])), description=raw.get("description", ""),
                                   timeout_s=int(raw.get("timeout_s", 3600)), lease_s=raw.get("lease_s"),
                                   resources=raw.get("resources") or {},
                                   before=tuple(tuple(map(str, b)) for b in before), service=service,
                                   grace_s=int(raw.get("grace_s", 600)))
    return out


# -- the lease lock ---------------------------------------------------------------------
class JobLock:
    """The job's lease (pipeline/lake/lease.py, name ``job-<name>``). ``acquire``
    returns False when another live holder has it (``held_by`` then says who);
    an expired lease is taken over by exactly one of any number of racers."""

    def __init__(self, lake: Lake, name: str, lease_s: int) -> None:
        self.lake, self.name, self.lease_s = lake, name, lease_s
        self.lease_name = f"job-{name}"
        self.lease: Lease | None = None
        self.held_by: dict[str, Any] | None = None

    def acquire(self) -> bool:
        from pipeline.lake.lease import try_acquire

        self.lease, self.held_by = try_acquire(
            self.lake, self.lease_name, ttl=self.lease_s,
            owner=f"pipeline jobs run {self.name} on {socket.gethostname()} pid {os.getpid()}")
        return self.lease is not None

    def holder(self) -> dict[str, Any] | None:
        from pipeline.lake.lease import holder

        return holder(self.lake, self.lease_name)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


# -- running ---------------------------------------------------------------------------------
def next_untrained_snapshot(lake: Lake) -> str | None:
    """The oldest admitted snapshot (one a receipt points to: a run that lost an
    admission race can leave a registered snapshot no receipt names) that no
    published checkpoint lists in snapshot_ids."""
    from pipeline.query.duck import query

    t = query(lake, """
        SELECT s.snapshot_id FROM snapshots s
        WHERE s.num_members > 0
          AND s.snapshot_id IN (SELECT snapshot_id FROM receipts WHERE snapshot_id IS NOT NULL)
          AND s.snapshot_id NOT IN (SELECT unnest(snapshot_ids) FROM checkpoints)
        ORDER BY s.created_at, s.snapshot_id LIMIT 1""")
    return t.column(0)[0].as_py() if t.num_rows else None


def resolve_args(lake: Lake, spec: JobSpec, *, now: float | None = None) -> list[str] | None:
    """Fill ``{slot}`` (minutes since the epoch: a fresh seed per scheduled run,
    the same one for a double start of the same run) and ``{next_snapshot}``."""
    slot = str(int((now if now is not None else time.time()) // 60))
    args = [a.replace("{slot}", slot) for a in spec.args]
    if any("{dynamic_groups" in a for a in args):
        import re

        from pipeline.admission.run import last_target, plan_next_rollout

        target = last_target(lake) if lake.exists("receipts") else None

        def groups(m: re.Match) -> str:
            return str(plan_next_rollout(target, default=int(m.group(1)), max_groups=int(m.group(2))))

        args = [re.sub(r"\{dynamic_groups:(\d+):(\d+)\}", groups, a) for a in args]
        bad = [a for a in args if "{dynamic_groups" in a]
        if bad:
            raise ConfigError(f"job {spec.name}: {bad[0]!r}: expected {{dynamic_groups:DEFAULT:MAX}}",
                              hint="e.g. --groups '{dynamic_groups:16:64}'")
    if any("{next_snapshot}" in a for a in args):
        snap = next_untrained_snapshot(lake)
        if snap is None:
            return None
        args = [a.replace("{next_snapshot}", snap) for a in args]
    return args


def run_job(lake: Lake, spec: JobSpec) -> dict[str, Any]:
    """Run one job once, in a subprocess, under its lease lock. Never raises:
    a failure is a result with status "error" (the scheduler keeps going)."""
    started = datetime.now(timezone.utc)
    try:
        return _run_job(lake, spec, started)
    except Exception as exc:  # a flaky store, a failing lookup: report it, schedule the next run
        return {"job": spec.name, "status": "error", "reason": f"{type(exc).__name__}: {exc}",
                "started_at": started.isoformat()}


def _run_job(lake: Lake, spec: JobSpec, started: datetime) -> dict[str, Any]:
    if spec.service:
        return {"job": spec.name, "status": "skipped", "started_at": started.isoformat(),
                "reason": f"{spec.name} is a service: run `pipeline {' '.join(spec.args)}` (a Deployment in "
                          "infra/k8s/services.yaml, a service in infra/compose.yaml)"}
    lock = JobLock(lake, spec.name, spec.lease)
    if not lock.acquire():
        from pipeline.lake.lease import describe_holder

        return {"job": spec.name, "status": "skipped",
                "reason": f"already running ({describe_holder(lock.lease_name, lock.held_by)})",
                "holder": (lock.held_by or {}).get("owner"), "started_at": started.isoformat()}
    try:
        args = resolve_args(lake, spec)
        if args is None:
            return {"job": spec.name, "status": "nothing_to_do", "reason": "no untrained snapshot",
                    "started_at": started.isoformat()}
        deadline = time.monotonic() + spec.timeout_s
        ol = lineage.ScheduledRun(lake, spec.name, args)
        try:
            for pre in spec.before:   # the bootstrap (e.g. policy init --if-missing): each must succeed
                proc = subprocess.run([sys.executable, "-m", "pipeline", *pre, "--lake", lake.uri],
                                      capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()),
                                      env=ol.env())
                if proc.returncode != 0:
                    return ol.finish({"job": spec.name, "status": "failed", "args": list(pre),
                                      "returncode": proc.returncode, "stdout": proc.stdout[-4000:],
                                      "stderr": proc.stderr[-4000:],
                                      "reason": f"before-step `pipeline {' '.join(pre)}` failed",
                                      "started_at": started.isoformat()})
            cmd = [sys.executable, "-m", "pipeline", *args, "--lake", lake.uri]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()),
                                  env=ol.env())
        except subprocess.TimeoutExpired:
            return ol.finish({"job": spec.name, "status": "timeout", "args": args, "timeout_s": spec.timeout_s,
                              "started_at": started.isoformat()})
        return ol.finish({"job": spec.name, "status": "ok" if proc.returncode == 0 else "failed", "args": args,
                "returncode": proc.returncode, "stdout": proc.stdout[-4000:], "stderr": proc.stderr[-4000:],
                "started_at": started.isoformat(),
                "seconds": round((datetime.now(timezone.utc) - started).total_seconds(), 3)})
    finally:
        lock.release()


def schedule(lake: Lake, jobs: dict[str, JobSpec], *, for_seconds: float | None = None,
             on_result=None) -> list[dict[str, Any]]:
    """Run every job on its cron schedule until stopped (Ctrl-C) or ``for_seconds``.
    A job whose previous run is still going is not started again."""
    from concurrent.futures import ThreadPoolExecutor

    from croniter import croniter

    jobs = {n: s for n, s in jobs.items() if not s.service}   # services run beside the scheduler
    if not jobs:
        raise NotFoundError("no jobs to schedule", hint="add YAML files to jobs/")
    start = time.time()
    nxt = {n: croniter(s.schedule, datetime.now(timezone.utc)).get_next(float) for n, s in jobs.items()}
    running: dict[str, Any] = {}
    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
        try:
            while for_seconds is None or time.time() - start < for_seconds:
                now = time.time()
                for name, fut in list(running.items()):
                    if fut.done():
                        res = fut.result()
                        results.append(res)
                        if on_result:
                            on_result(res)
                        del running[name]
                for name, spec in jobs.items():
                    if now >= nxt[name]:
                        nxt[name] = croniter(spec.schedule, datetime.fromtimestamp(now, timezone.utc)).get_next(float)
                        if name not in running:
                            running[name] = pool.submit(run_job, lake, spec)
                time.sleep(min(0.2, max(0.0, min(nxt.values()) - time.time())))
        except KeyboardInterrupt:
            pass
        for fut in running.values():
            res = fut.result()
            results.append(res)
            if on_result:
                on_result(res)
    return results


# -- infra rendering (kept consistent with jobs/ by a test) ------------------------------------
def default_image() -> str:
    """The CPU image, tagged with the package version (never a floating tag)."""
    from pipeline import __version__

    return f"trajectory-lakehouse:{__version__}-cpu"


def render_cronjobs(jobs: dict[str, JobSpec], *, image: str | None = None) -> str:
    """Kubernetes CronJobs, one per job, as one multi-document YAML."""

    image = image or default_image()
    docs = []
    for spec in jobs.values():
        if spec.service:
            continue
        if len(spec.schedule.split()) != 5:
            raise PipelineError(f"job {spec.name}: Kubernetes CronJobs need a 5-field schedule")
        res = spec.resources or {"cpu": "1", "memory": "4Gi"}
        env_from = [{"configMapRef": {"name": "pipeline-lake"}},
                    {"secretRef": {"name": "pipeline-s3", "optional": True}},
                    {"secretRef": {"name": "nats-auth", "optional": True}}]   # the front door's credentials
        docs.append({
            "apiVersion": "batch/v1",
            "kind": "CronJob",
            "metadata": {"name": f"pipeline-{spec.name}", "labels": {"app": "trajectory-lakehouse", "job": spec.name}},
            "spec": {
                "schedule": spec.schedule,
                # the lake lease lock makes a double start harmless; Forbid makes it rare
                "concurrencyPolicy": "Forbid",
                "startingDeadlineSeconds": 300,
                "successfulJobsHistoryLimit": 3,
                "failedJobsHistoryLimit": 3,
                "jobTemplate": {"spec": {
                    "backoffLimit": 2,
                    "activeDeadlineSeconds": spec.timeout_s,
                    "template": {"spec": {
                        # `jobs run` also runs the job's `before` steps (the bootstrap) under its lease
                        "restartPolicy": "Never",
                        "containers": [{
                            "name": spec.name,
                            "image": image,
                            "args": ["jobs", "run", spec.name],
                            "envFrom": env_from,
                            "resources": {"requests": res, "limits": res},
                        }],
                    }},
                }},
            },
        })
    return _dump(docs)


def _dump(docs: list[dict[str, Any]]) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):   # plain YAML: no &id001 anchors for repeated mappings
        def ignore_aliases(self, data: Any) -> bool:
            return True

    header = "# Generated from jobs/*.yaml by `python -m pipeline.jobs --render-k8s`; do not edit.\n"
    return header + yaml.dump_all(docs, Dumper=Dumper, sort_keys=False)


def render_services(jobs: dict[str, JobSpec], *, image: str | None = None) -> str:
    """Kubernetes Deployments, one per service: one replica, replaced with
    ``Recreate`` (the old pod stops before the new one starts), the ``before``
    steps as an init container."""
    image = image or default_image()
    env_from = [{"configMapRef": {"name": "pipeline-lake"}}, {"secretRef": {"name": "pipeline-s3", "optional": True}},
                {"secretRef": {"name": "nats-auth", "optional": True}}]
    docs = []
    for spec in jobs.values():
        if not spec.service:
            continue
        res = spec.resources or {"cpu": "1", "memory": "4Gi"}
        labels = {"app": "trajectory-lakehouse", "service": spec.name}
        pod: dict[str, Any] = {
            "terminationGracePeriodSeconds": spec.grace_s,
            "containers": [{"name": spec.name, "image": image, "args": list(spec.args), "envFrom": env_from,
                            "resources": {"requests": res, "limits": res}}],
        }
        if spec.before:
            pod["initContainers"] = [{"name": f"{spec.name}-before-{i}", "image": image, "args": list(b),
                                      "envFrom": env_from} for i, b in enumerate(spec.before)]
        docs.append({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": f"pipeline-{spec.name}", "labels": labels},
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": pod}},
        })
    return _dump(docs)


def render_main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.jobs --render-k8s [--out DIR] [--image IMAGE] [--jobs-dir DIR]``: write
    DIR/cronjobs.yaml and DIR/services.yaml (default DIR: ./infra/k8s when run from a checkout).
    Never writes into the installed package."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m pipeline.jobs",
                                description="Render the Kubernetes CronJobs and Deployments of jobs/*.yaml.")
    p.add_argument("--render-k8s", action="store_true", required=True, help="write cronjobs.yaml, services.yaml")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="directory to write cronjobs.yaml into (default: ./infra/k8s if it exists)")
    p.add_argument("--image", default=None, help="container image of every job (default: trajectory-lakehouse:VERSION-cpu)")
    p.add_argument("--jobs-dir", default=None, metavar="DIR", help="job YAML files (default: the packaged jobs/)")
    args = p.parse_args(argv)
    if args.out is None:
        if not Path("infra/k8s").is_dir():
            print("error: no ./infra/k8s here; pass --out DIR", file=sys.stderr)
            return 2
        args.out = "infra/k8s"
    out = Path(args.out) / "cronjobs.yaml"
    services = Path(args.out) / "services.yaml"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        jobs = load_jobs(args.jobs_dir)
        out.write_text(render_cronjobs(jobs, image=args.image))
        services.write_text(render_services(jobs, image=args.image))
    except (OSError, PipelineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} and {services}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(render_main(sys.argv[1:]))
