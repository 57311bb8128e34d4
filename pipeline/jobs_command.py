"""CLI: `pipeline jobs list|run NAME|schedule`."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.cli import common

    jobs = sub.add_parser("jobs", help="scheduled jobs from jobs/ (run one once, or schedule all)")
    jsub = jobs.add_subparsers(dest="jobs_command", metavar="ACTION")
    ls = common(jsub.add_parser("list", help="the jobs and their schedules"))
    ls.add_argument("--jobs-dir", default=None, help="directory of job YAML files (default: the packaged jobs/)")
    ls.set_defaults(handler=_list)
    r = common(jsub.add_parser("run", help="run one job once (guarded: a double start yields one run)"))
    r.add_argument("name")
    r.add_argument("--jobs-dir", default=None)
    r.set_defaults(handler=_run)
    s = common(jsub.add_parser("schedule", help="run every job on its schedule in the foreground until stopped"))
    s.add_argument("--jobs-dir", default=None)
    s.add_argument("--only", action="append", default=None, help="schedule only these jobs (repeatable)")
    s.add_argument("--for-seconds", type=float, default=None, help="stop after this long (default: until Ctrl-C)")
    s.set_defaults(handler=_schedule)
    jobs.set_defaults(handler=lambda a: jobs.print_help())


def _list(args):
    from pipeline.cli import emit
    from pipeline.jobs import load_jobs

    jobs = load_jobs(args.jobs_dir)
    emit({n: {"schedule": j.schedule, "args": list(j.args), "description": j.description} for n, j in jobs.items()},
         args, lambda r: "\n".join(f"{n:12s} {v['schedule']:16s} pipeline {' '.join(v['args'])}" for n, v in r.items()))


def _run(args):
    from pipeline.cli import emit
    from pipeline.errors import NotFoundError
    from pipeline.jobs import load_jobs, run_job
    from pipeline.lake.delta import Lake

    jobs = load_jobs(args.jobs_dir)
    if args.name not in jobs:
        raise NotFoundError(f"no job {args.name!r}", hint=f"jobs: {', '.join(sorted(jobs))}")
    res = run_job(Lake(args.lake), jobs[args.name])
    emit(res, args, lambda r: f"job {r['job']}: {r['status']}"
         + (f" ({r['reason']})" if r.get("reason") else "")
         + (f"\n{r['stdout'].rstrip()}" if r.get("stdout") else "")
         + (f"\n{r['stderr'].rstrip()}" if r.get("status") == "failed" and r.get("stderr") else ""))
    return 0 if res["status"] in ("ok", "skipped", "nothing_to_do") else 1


def _schedule(args):
    from pipeline.jobs import load_jobs, schedule
    from pipeline.lake.delta import Lake

    jobs = load_jobs(args.jobs_dir)
    if args.only:
        jobs = {n: j for n, j in jobs.items() if n in args.only}
    print(f"scheduling {', '.join(f'{n} ({j.schedule})' for n, j in jobs.items())}; Ctrl-C to stop", flush=True)

    def show(r):
        print(json.dumps(r, default=str) if args.json else f"{r['started_at']} {r['job']}: {r['status']}", flush=True)

    schedule(Lake(args.lake), jobs, for_seconds=args.for_seconds, on_result=show)
