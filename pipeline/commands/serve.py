"""`pipeline serve --nats URL`: the committer behind the lake's front door (docs/front-door.md)."""

from __future__ import annotations

import argparse
import os


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.clikit import common

    p = common(sub.add_parser(
        "serve", help="commit batches published to the lake's log (NATS JetStream), exactly once",
        description="Pull every table's subject of the lake's JetStream stream, land the rows as pipeline "
                    "ingest does (valid rows land, the rest is quarantined with a reason), one Delta commit "
                    "per table per flush carrying the stream sequence it covers, then ack. One committer per "
                    "table: a second one refuses (or waits with --standby). Runs until SIGTERM/SIGINT. "
                    "Producers: pipeline.landing.connect(URL); outcomes in the lake (docs/front-door.md)."))
    p.add_argument("--nats", default=os.environ.get("PIPELINE_INGEST_URL"), metavar="URL",
                   help="the NATS server (nats://[user:pass@]host:4222; default $PIPELINE_INGEST_URL); "
                        "credentials also from NATS_USER/NATS_PASSWORD or NATS_TOKEN, TLS from NATS_TLS_CA")
    p.add_argument("--stream", default="lake", help="the lake's stream (subjects <stream>.<table>; default lake)")
    p.add_argument("--tables", default="trajectories,events", help="tables to serve (default trajectories,events)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="at most one commit per table per S seconds (default 1)")
    p.add_argument("--linger", type=float, default=0.2, metavar="S",
                   help="a flush waits S seconds after its first message for more (default 0.2)")
    p.add_argument("--max-messages", type=int, default=2000, metavar="N",
                   help="hold at most N pulled messages; past that, pulling pauses until the next flush (default 2000)")
    p.add_argument("--max-bytes", type=int, default=1 << 30, metavar="B",
                   help="the stream's size limit when serve creates it: past it producers get a retriable "
                        "'log is full' error (default 1 GiB)")
    p.add_argument("--replicas", type=int, default=1, help="stream replicas when serve creates it (3 in a cluster)")
    p.add_argument("--standby", action="store_true", help="wait for the running committer's lease instead of refusing")
    p.add_argument("--ready-file", default=None, metavar="PATH",
                   help="touch PATH once serving and at every pull (a readiness probe checks its age); removed on exit")
    p.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from pipeline.clikit import note, open_lake
    from pipeline.errors import ConfigError
    from pipeline.landing.committer import ServeSettings
    from pipeline.landing.serve import check_reachable, print_flush, serve

    if not args.nats:
        raise ConfigError("pipeline serve needs the log's address", hint="give --nats nats://host:4222 or set "
                                                                         "PIPELINE_INGEST_URL")
    tables = tuple(t.strip() for t in args.tables.split(",") if t.strip())
    if args.interval <= 0 or args.linger < 0 or args.max_messages < 1:
        raise ConfigError("--interval must be > 0, --linger >= 0 and --max-messages >= 1")
    s = ServeSettings(stream=args.stream, tables=tables, interval_s=args.interval, linger_s=args.linger,
                      max_messages=args.max_messages,
                      max_bytes=args.max_bytes, replicas=args.replicas)
    check_reachable(args.nats)        # before the lake is created: a wrong address must not leave a new lake behind
    lake = open_lake(args, create=True)
    return serve(lake, args.nats, s, standby=args.standby, on_flush=print_flush, ready_file=args.ready_file,
                 ready=lambda: note(f"serving {', '.join(tables)} from {args.stream} (ready)"))
