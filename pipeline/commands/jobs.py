"""CLI: `pipeline jobs list|run NAME|schedule|render-k8s`."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.clikit import common

    jobs = sub.add_parser("jobs", help="scheduled jobs from jobs/ (run one once, or schedule all)")
    jsub = jobs.add_subparsers(dest="jobs_command", metavar="ACTION")
    jobs_dir_help = "directory of job YAML files (default: the packaged jobs/)"
    ls = common(jsub.add_parser("list", help="the jobs and their schedules"))
    ls.add_argument("--jobs-dir", default=None, help=jobs_dir_help)
    ls.set_defaults(handler=_list)
    r = common(jsub.add_parser("run", help="run one job once (guarded: a double start yields one run)"))
    r.add_argument("name", help="job name (pipeline jobs list)")
    r.add_argument("--jobs-dir", default=None, help=jobs_dir_help)
    r.set_defaults(handler=_run)
    s = common(jsub.add_parser("schedule", help="run every job on its schedule in the foreground until stopped"))
    s.add_argument("--jobs-dir", default=None, help=jobs_dir_help)
    s.add_argument("--only", action="append", default=None, help="schedule only these jobs (repeatable)")
    s.add_argument("--for-seconds", type=float, default=None, help="stop after this long (default: until Ctrl-C)")
    s.set_defaults(handler=_schedule)
    k = common(jsub.add_parser("render-k8s", help="write the Kubernetes CronJobs and Deployments of the jobs "
                                                   "(cronjobs.yaml, services.yaml)"))
    k.add_argument("--out", default=None, metavar="DIR",
                   help="directory to write cronjobs.yaml and services.yaml into "
                        "(default: ./infra/k8s when run from a checkout)")
    k.add_argument("--image", default=None,
                   help="container image of every job (default: trajectory-lakehouse:VERSION-cpu)")
    k.add_argument("--jobs-dir", default=None, help=jobs_dir_help)
    k.set_defaults(handler=_render_k8s)
    jobs.set_defaults(handler=lambda a: jobs.print_help())


def _render_k8s(args):
    """The same two files as ``python -m pipeline.jobs --render-k8s``: the scheduled jobs'
    CronJobs and the services' (the resident trainer's) Deployments; both rendered before
    either is written."""
    from pathlib import Path

    from pipeline.clikit import emit
    from pipeline.errors import ConfigError
    from pipeline.jobs import load_jobs, render_cronjobs, render_services

    if args.out is None:
        if not Path("infra/k8s").is_dir():
            raise ConfigError("no ./infra/k8s here to write cronjobs.yaml and services.yaml into", hint="pass --out DIR")
        args.out = "infra/k8s"
    jobs = load_jobs(args.jobs_dir)
    texts = {Path(args.out) / "cronjobs.yaml": render_cronjobs(jobs, image=args.image),
             Path(args.out) / "services.yaml": render_services(jobs, image=args.image)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for path, text in texts.items():
        path.write_text(text)
    cron, services = texts.values()
    emit({"path": str(Path(args.out) / "cronjobs.yaml"), "paths": [str(p) for p in texts],
          "cronjobs": cron.count("kind: CronJob"), "deployments": services.count("kind: Deployment")}, args,
         lambda r: f"wrote {' and '.join(r['paths'])} ({r['cronjobs']} CronJobs, {r['deployments']} Deployments)")


def _list(args):
    from pipeline.clikit import emit
    from pipeline.jobs import load_jobs

    jobs = load_jobs(args.jobs_dir)
    emit({n: {"schedule": j.schedule, "args": list(j.args), "description": j.description} for n, j in jobs.items()},
         args, lambda r: "\n".join(f"{n:12s} {v['schedule']:16s} pipeline {' '.join(v['args'])}" for n, v in r.items()))


def _run(args):
    from pipeline.clikit import emit, open_lake
    from pipeline.errors import NotFoundError
    from pipeline.jobs import load_jobs, run_job

    jobs = load_jobs(args.jobs_dir)
    if args.name not in jobs:
        raise NotFoundError(f"no job {args.name!r}", hint=f"jobs: {', '.join(sorted(jobs))}")
    res = run_job(open_lake(args, create=True), jobs[args.name])
    emit(res, args, lambda r: f"job {r['job']}: {r['status']}"
         + (f" ({r['reason']})" if r.get("reason") else "")
         + (f"\n{r['stdout'].rstrip()}" if r.get("stdout") else "")
         + (f"\n{r['stderr'].rstrip()}" if r.get("status") == "failed" and r.get("stderr") else ""))
    return 0 if res["status"] in ("ok", "skipped", "nothing_to_do") else 1


def _schedule(args):
    from pipeline.clikit import note, open_lake, out
    from pipeline.errors import NotFoundError
    from pipeline.jobs import load_jobs, schedule

    jobs = load_jobs(args.jobs_dir)
    if args.only:
        unknown = sorted(set(args.only) - set(jobs))
        if unknown:
            raise NotFoundError(f"no job(s) {', '.join(unknown)}", hint=f"jobs: {', '.join(sorted(jobs))}")
        jobs = {n: j for n, j in jobs.items() if n in args.only}
    lake = open_lake(args, create=True)
    note(f"scheduling {', '.join(f'{n} ({j.schedule})' for n, j in jobs.items())}; Ctrl-C to stop")

    def show(r):   # one line (or one JSON document per line with --json) per finished run
        out(json.dumps(r, default=str) if args.json else f"{r['started_at']} {r['job']}: {r['status']}")

    schedule(lake, jobs, for_seconds=args.for_seconds, on_result=show)
