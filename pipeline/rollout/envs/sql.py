"""``sql-agent``: answer a question about a SQLite database by running queries
(a stateful environment; the protocol is ``Stateful`` in envs/base.py).

Each task names a database and a question; the answer is a number, verified
against the reference query's result on the database as it was recorded. The
databases are real SQLite files (stdlib ``sqlite3``), built deterministically
and stored *content-addressed*: ``<store>/snapshots/<sha256>.sqlite``, the
name being the SHA-256 of the file's bytes. An episode never touches a
snapshot: ``open`` copies it to ``<store>/episodes/<episode_id>.sqlite`` (the
episode's own database: whatever the policy's queries write stays there),
checks the copy's hash and returns it, the harness records it as the
trajectory's ``env_state_hash``; ``close`` deletes the copy. After a crash the
harness calls ``open`` again with the actions already executed (``replay``):
the copy is rebuilt from the snapshot and those actions re-applied, so a
half-finished episode continues from exactly the state it had, whatever its
old copy holds (or on another machine, where there is none). That is also why
the tool is ``idempotent``: an action whose outcome was unknown at the crash
runs again on the state before it.

The policy writes plain SQL between ``<call>`` and ``</call>`` in the
character vocabulary (lowercase, digits, ``( ) , . * = < > + - /``: no quotes,
so the questions are about ids); a query's rows come back as values joined by
``,`` and rows by `` : ``, an SQL error as ``error: ...`` (the policy's
mistake, an observation like any other).
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import sqlite3
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pipeline.rollout.envs.base import Task, ToolError, Verification, register_env, split_of

SCHEMA_TEXT = "customers(id,city) orders(id,customer,product,qty) products(id,price)"
DATABASES = {"shopa": 11, "shopb": 12}          # name -> the seed it is built from
MAX_ROWS = 1000                                  # rows one query returns at most
QUESTIONS = {
    "orders": ("how many orders has customer {p}?", "select count(*) from orders where customer = {p}", 12),
    "qty": ("total qty ordered of product {p}?", "select coalesce(sum(qty), 0) from orders where product = {p}", 8),
    "city": ("how many customers live in city {p}?", "select count(*) from customers where city = {p}", 5),
    "spend": ("total spent by customer {p}?",
              "select coalesce(sum(o.qty * p.price), 0) from orders o join products p on p.id = o.product "
              "where o.customer = {p}", 12),
}


def build_database(path: Path, seed: int) -> None:
    """A small shop database, the same bytes for the same seed and SQLite."""
    rng = random.Random(seed)
    con = sqlite3.connect(path)
    try:
        con.executescript("create table customers(id integer primary key, city integer);"
                          "create table products(id integer primary key, price integer);"
                          "create table orders(id integer primary key, customer integer, product integer, "
                          "qty integer);")
        con.executemany("insert into customers values (?, ?)", [(i, rng.randint(1, 5)) for i in range(1, 13)])
        con.executemany("insert into products values (?, ?)", [(i, rng.randint(1, 20)) for i in range(1, 9)])
        con.executemany("insert into orders values (?, ?, ?, ?)",
                        [(i, rng.randint(1, 12), rng.randint(1, 8), rng.randint(1, 5)) for i in range(1, 61)])
        con.commit()
    finally:
        con.close()


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def render(rows: list[tuple]) -> str:
    return " : ".join(",".join("null" if v is None else str(v).lower() for v in row) for row in rows)


@register_env
class SqlAgent:
    name = "sql-agent"
    version = "sql-agent/1"
    env_version = "sql-agent/1"
    verifier_version = "sql-exact/1"
    prompt_template_rev = "sql:{db}:{schema}:{question}=/1"
    tool_schema_version = "sql/1"
    component_tags = {"task_success": "fact", "format": "heuristic"}
    multi_turn = True
    idempotent = True          # a re-run follows a restore from the snapshot (module docstring)
    databases: dict[str, int] = DATABASES       # name -> the seed its snapshot is built from

    def build(self, path: Path, seed: int) -> None:
        """Write database ``seed``'s file at ``path`` (deterministic: the same bytes every time)."""
        build_database(path, seed)

    def __init__(self, store: str | os.PathLike[str] | None = None) -> None:
        root = store or os.environ.get("PIPELINE_SQL_STORE") or Path(tempfile.gettempdir()) / "pipeline-sql"
        self.store = Path(root)
        (self.store / "snapshots").mkdir(parents=True, exist_ok=True)
        (self.store / "episodes").mkdir(parents=True, exist_ok=True)
        self._snapshots: dict[str, str] = {}

    # -- snapshots -------------------------------------------------------------------------
    def snapshot(self, db: str) -> str:
        """The content hash of database ``db``'s snapshot (built and stored once)."""
        if db not in self._snapshots:
            if db not in self.databases:
                raise ToolError(f"{self.name}: unknown database {db!r}")
            fd, tmp = tempfile.mkstemp(dir=self.store / "snapshots", suffix=".tmp")
            os.close(fd)
            os.unlink(tmp)
            self.build(Path(tmp), self.databases[db])
            h = file_hash(Path(tmp))
            os.replace(tmp, self.snapshot_path(h))      # content-addressed: same name, same bytes
            self._snapshots[db] = h
        return self._snapshots[db]

    def snapshot_path(self, state_hash: str) -> Path:
        return self.store / "snapshots" / f"{state_hash}.sqlite"

    def _copy(self, episode_id: str) -> Path:
        return self.store / "episodes" / f"{episode_id}.sqlite"

    # -- the stateful lifecycle ----------------------------------------------------------------
    def open(self, episode_id: str, task: Task, replay: Sequence[str] = ()) -> str:
        state = str(task.meta["snapshot"])
        snap = self.snapshot_path(state)
        if not snap.exists():
            self.snapshot(str(task.meta["db"]))
        if not snap.exists() or file_hash(snap) != state:
            raise ToolError(f"sql-agent: snapshot {state[:12]} of {task.meta['db']!r} is missing or changed")
        copy = self._copy(episode_id)
        tmp = copy.with_suffix(".tmp")
        shutil.copyfile(snap, tmp)
        for action in replay:                       # the actions executed before a crash, in order
            self._run(tmp, action)
        os.replace(tmp, copy)
        return state

    def close(self, episode_id: str) -> None:
        self._copy(episode_id).unlink(missing_ok=True)

    # -- the environment -------------------------------------------------------------------------
    def reset(self, seed: int, split: str = "train") -> Task:
        rng = random.Random(seed)
        while True:
            db = rng.choice(sorted(DATABASES))
            kind = rng.choice(sorted(QUESTIONS))
            question, sql, top = QUESTIONS[kind]
            p = rng.randint(1, top)
            task_id = f"sql-{db}-{kind}-{p}"
            if split_of(task_id) == split:
                break
        state = self.snapshot(db)
        con = sqlite3.connect(f"file:{self.snapshot_path(state)}?mode=ro", uri=True)
        try:
            answer = str(con.execute(sql.format(p=p)).fetchone()[0])
        finally:
            con.close()
        prompt = f"db {db}: {SCHEMA_TEXT}. {question.format(p=p)}="
        return Task(task_id, prompt, answer=answer, difficulty=kind,
                    meta={"db": db, "snapshot": state, "sql": sql.format(p=p)})

    def step(self, task: Task, action: str, *, key: str) -> str:
        episode_id = key.rsplit("/", 1)[0]
        copy = self._copy(episode_id)
        if not copy.exists():
            raise ToolError(f"sql-agent: episode {episode_id} has no database (not opened, or closed)")
        return self._run(copy, action)

    @staticmethod
    def _run(path: Path, action: str) -> str:
        try:       # mode=rw: a copy closed meanwhile (an abandoned call) is an error, never a new empty file
            con = sqlite3.connect(f"file:{path}?mode=rw", uri=True)
        except sqlite3.OperationalError as exc:
            raise ToolError(f"sql-agent: cannot open {path.name}: {exc}") from None
        try:
            rows = con.execute(action).fetchmany(MAX_ROWS)
            con.commit()
        except sqlite3.Error as exc:                # the policy's query failed: an observation
            return f"error: {str(exc).lower()}"
        finally:
            con.close()
        return render(rows)

    def verify(self, task: Task, answer: str | None, num_tool_calls: int) -> Verification:
        if answer is None:
            return Verification("FAIL", 0.0, {"task_success": 0.0, "format": 0.0}, format_ok=False)
        ok = answer.strip() == task.answer
        return Verification("PASS" if ok else "FAIL", float(ok), {"task_success": float(ok), "format": 1.0})


# -- sql-lookup: the SQL task the tiny demo policy can learn (issue 41's evidence) ------------------------------
LOOKUP_KEYS = (100, 999)        # keys of table t, inclusive
HOT_ROWS = 8                    # rows a hot key has in sql-lookup-hot


def is_hot(k: int, fraction: float) -> bool:
    """Whether key ``k`` is one of the hot keys (a fixed hash of the key, ``fraction`` of them)."""
    return int.from_bytes(hashlib.sha256(f"hot-{k}".encode()).digest()[:4], "big") % 1000 < round(fraction * 1000)


def build_lookup(path: Path, seed: int, hot_fraction: float = 0.0) -> None:
    """Table ``t(k, v)``: one row per key ``k`` in ``LOOKUP_KEYS`` with ``v = 10 k + d``
    (``d`` a digit drawn per key from ``seed``); a hot key (``is_hot``) has its row
    ``HOT_ROWS`` times (a log that was never compacted). Same bytes for the same arguments."""
    rng = random.Random(seed)
    rows = []
    for k in range(LOOKUP_KEYS[0], LOOKUP_KEYS[1] + 1):
        v = 10 * k + rng.randint(0, 9)
        rows += [(k, v)] * (HOT_ROWS if is_hot(k, hot_fraction) else 1)
    con = sqlite3.connect(path)
    try:
        con.executescript("create table t(k integer, v integer); create index t_k on t(k);")
        con.executemany("insert into t values (?, ?)", rows)
        con.commit()
    finally:
        con.close()


@register_env
class SqlLookup(SqlAgent):
    """``sql-lookup``: the value ``v`` of key ``k`` in table ``t(k, v)``, a task the
    built-in tiny policy (128 positions, character vocabulary) can learn; the same
    stateful lifecycle as ``sql-agent`` (a content-addressed snapshot per episode,
    its own copy, replay on resume).

    Prompt ``v of 370=``; the query ``select v from t where k=370`` returns
    ``3704``; reward (like ``flaky-tool``'s): the exact value pays
    ``1 - 0.05 x queries``; a wrong answer given without a query earns
    ``estimate_credit x max(0, 1 - |answer - v| / 10)`` (``v = 10 k + d``: a
    direct answer can be close, exact 1 time in 10); a wrong answer after a
    query (a copying slip) and a broken format earn 0. So a query that comes
    back (0.95) beats any direct answer (< 0.8 when wrong). Held-out split by key.
    """

    name = "sql-lookup"
    version = "sql-lookup/1"
    env_version = "sql-lookup/1"
    verifier_version = "lookup-verifier/1"
    prompt_template_rev = "v of {k}=/1"
    component_tags = {"task_success": "fact", "estimate": "fact", "format": "heuristic", "tool_cost": "heuristic"}
    db = "lookup"
    databases = {"lookup": 21}
    hot_fraction = 0.0              # share of keys with HOT_ROWS rows
    estimate_credit = 0.8

    def build(self, path: Path, seed: int) -> None:
        build_lookup(path, seed, self.hot_fraction)

    def reset(self, seed: int, split: str = "train") -> Task:
        rng = random.Random(seed)
        while True:
            k = rng.randint(*LOOKUP_KEYS)
            if split_of(f"lookup-{k}") == split:
                break
        state = self.snapshot(self.db)
        sql = f"select v from t where k={k}"
        con = sqlite3.connect(f"file:{self.snapshot_path(state)}?mode=ro", uri=True)
        try:
            answer = str(con.execute(sql).fetchone()[0])
        finally:
            con.close()
        hot = is_hot(k, self.hot_fraction)
        return Task(f"lookup-{k}", f"v of {k}=", answer=answer, difficulty="hot" if hot else "cold",
                    meta={"db": self.db, "snapshot": state, "sql": sql, "k": k})

    def demonstration(self, task: Task, rng: random.Random, tool_fraction: float = 0.5) -> list[tuple[str, bool]]:
        ans = f"<ans>{task.answer}<eos>"
        if rng.random() < tool_fraction:     # the query and its one-row result (a demonstration never sees a hot key's)
            return [(f"<call>{task.meta['sql']}</call>", True), (f"<obs>{task.answer}</obs>", False), (ans, True)]
        return [(ans, True)]

    def verify(self, task: Task, answer: str | None, num_tool_calls: int) -> Verification:
        text = (answer or "").strip()
        if answer is None or not text.isdigit():
            return Verification("FAIL", 0.0, {"task_success": 0.0, "estimate": 0.0, "format": 0.0,
                                              "tool_cost": -0.05 * num_tool_calls}, format_ok=False)
        v, got = int(task.answer), int(text)
        cost = -0.05 * num_tool_calls
        if got == v:
            return Verification("PASS", max(0.0, 1.0 + cost), {"task_success": 1.0, "estimate": 0.0, "format": 1.0,
                                                               "tool_cost": cost})
        est = self.estimate_credit * max(0.0, 1 - abs(got - v) / 10) if num_tool_calls == 0 else 0.0
        return Verification("FAIL", est, {"task_success": 0.0, "estimate": est, "format": 1.0, "tool_cost": cost})


@register_env
class SqlLookupHot(SqlLookup):
    """``sql-lookup-hot``: ``sql-lookup`` over a table where half the keys are hot
    (``HOT_ROWS`` rows each): the same query returns ``3704 : 3704 : ...`` (8 rows,
    53 characters), a verbose result that an observation budget of 16 tokens
    cannot hold (nor its truncation marker): the episode ends ``obs_budget``. The
    training environment of the observation-budget ablation (benchmarks/bench_sql_obs.py)."""

    name = "sql-lookup-hot"
    version = "sql-lookup-hot/1"
    env_version = "sql-lookup-hot/1"
    db = "lookup-hot"
    databases = {"lookup-hot": 21}        # the same values as sql-lookup's (the same seed), hot keys repeated
    hot_fraction = 0.5
