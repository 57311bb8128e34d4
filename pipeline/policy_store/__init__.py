"""Policy versions, published through the ``checkpoints`` table.

A policy version is a checkpoint directory holding at least ``hf/`` (a
Hugging Face model directory: config.json, model.safetensors, tokenizer files)
that the rollout engines and the trainer load. Every publishing run writes its
files under a directory of its own, ``<lake>/_checkpoints/<checkpoint_id>.<run tag>/``
(``run_checkpoint_rel``; lakes written before name ``_checkpoints/<checkpoint_id>/``),
and the row's ``path`` names it: files are never written where a published row
points. Publication = appending the checkpoints row (with the sha256 of every
file) *after* every file is written, so a reader that resolves "the newest
version" through the table never sees a half-written one; of any number of
runs publishing one checkpoint id, exactly one row lands (docs/write-protocol.md,
"Publishing a policy version"). Loaders rehash the files against the row before
use: checkpoints contain pickles (optimizer state), and only hash-verified,
project-produced ones are ever loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pipeline import __version__
from pipeline.errors import IntegrityError, NotFoundError
from pipeline.lake.ref import as_lake
from pipeline.resources import machine_cache

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

HF_SUBDIR = "hf"
_CHECKED: dict[tuple[str, str], tuple] = {}  # (local dir, checkpoint id) -> (hashes, file stats) verified


def _stats(local: Path, files: dict[str, str]) -> dict[str, tuple[int, int] | None]:
    out: dict[str, tuple[int, int] | None] = {}
    for rel in files:
        try:
            st = (local / rel).stat()
            out[rel] = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            out[rel] = None
    return out


@dataclass(frozen=True)
class PolicyRef:
    checkpoint_id: str
    policy_version: int
    path: Path                  # local checkpoint directory
    file_sha256: dict[str, str]
    hf_path: Path | None = None  # a user's plain HF directory (no checkpoint around it), or the rebuilt
    #                              weights of a delta-only version (policy_store.delta.materialize)
    rel: str = ""                # the published directory, relative to the lake (the row's path)

    @property
    def hf_dir(self) -> Path:
        return self.hf_path if self.hf_path is not None else self.path / HF_SUBDIR


def checkpoint_rel(checkpoint_id: str) -> str:
    return f"_checkpoints/{checkpoint_id}"


def run_tag() -> str:
    """A tag no other run shares: ``PIPELINE_RUN_TAG`` (set by the launcher for all
    ranks of one run), else UTC time + random."""
    tag = os.environ.get("PIPELINE_RUN_TAG")
    return tag or f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"


def run_checkpoint_rel(checkpoint_id: str, tag: str | None = None) -> str:
    """The directory one run writes checkpoint ``checkpoint_id`` into: its own, so two
    runs of one id never write the same files; the winner's row names it."""
    return f"_checkpoints/{checkpoint_id}.{tag or run_tag()}"


def row_rel(row: dict[str, Any]) -> str:
    """A published row's directory (its ``path``; the legacy layout when unset)."""
    return row.get("path") or checkpoint_rel(row["checkpoint_id"])


def local_dir(lake: Lake, rel: str) -> Path:
    """Where the checkpoint directory ``rel`` (relative to the lake) lives on this
    machine: the lake itself when local; a cache directory for object-store lakes,
    filled by ``fetch_checkpoint``."""
    if lake.is_local:
        return Path(lake.uri) / rel
    return machine_cache("checkpoints", lake.uri) / rel.removeprefix("_checkpoints/")


def local_checkpoint_dir(lake: Lake, checkpoint_id: str) -> Path:
    """``local_dir`` of ``_checkpoints/<checkpoint_id>`` (the layout before per-run
    directories; also the home of ``_runs/``, ``_trackers``)."""
    return local_dir(lake, checkpoint_rel(checkpoint_id))


def published_rel(lake: Lake | str | os.PathLike[str], checkpoint_id: str) -> str:
    """The directory (relative to the lake) the row of a published checkpoint names."""
    lake = as_lake(lake)
    rows = [r for r in checkpoint_rows(lake) if r["checkpoint_id"] == checkpoint_id]
    if not rows:
        raise NotFoundError(f"checkpoint {checkpoint_id} not found")
    return row_rel(rows[0])


def published_dir(lake: Lake | str | os.PathLike[str], checkpoint_id: str) -> Path:
    """The local directory of a published checkpoint (files not fetched nor verified)."""
    lake = as_lake(lake)
    return local_dir(lake, published_rel(lake, checkpoint_id))


def code_version() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent).stdout.strip()
    except Exception:
        sha = ""
    return f"{__version__}+{sha}" if sha else __version__


def hash_dir(path: Path) -> dict[str, str]:
    """relative path -> sha256 for every file under ``path``."""
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            out[p.relative_to(path).as_posix()] = h.hexdigest()
    return out


def verify_dir(path: Path, expected: dict[str, str], *, what: str) -> None:
    actual = hash_dir(path)
    missing = sorted(set(expected) - set(actual))
    if missing:
        raise IntegrityError(f"{what}: file(s) missing: {missing[:5]}", hint="the checkpoint is incomplete or was moved")
    bad = sorted(k for k in expected if actual[k] != expected[k])
    if bad:
        raise IntegrityError(f"{what}: sha256 mismatch for {bad[:5]}",
                             hint="the files were modified after publication; refusing to load them")


def checkpoint_rows(lake: Lake) -> list[dict[str, Any]]:
    """The published rows (id, version, path, file sha256, created_at, snapshot ids, train config)."""
    if not lake.exists("checkpoints"):
        return []
    t = lake.read("checkpoints", columns=["checkpoint_id", "policy_version", "path", "file_sha256", "created_at",
                                          "snapshot_ids", "train_config_json"])
    return t.to_pylist()


def latest_policy_version(lake: Lake | str | os.PathLike[str]) -> int | None:
    lake = as_lake(lake)
    rows = checkpoint_rows(lake)
    return max((r["policy_version"] for r in rows), default=None)


def next_policy_version(lake: Lake) -> int:
    v = latest_policy_version(lake)
    return 0 if v is None else v + 1


def resolve_policy(lake: Lake | str | os.PathLike[str], spec: str | int | None = None, *, verify: bool = True,
                   weights: bool = True) -> PolicyRef:
    """A policy by version number, checkpoint id, ``latest`` (None), or a local
    HF directory path (not verified: a user's own model). A delta-only version's
    ``hf_dir`` is its rebuilt weights (``delta.materialize``); ``weights=False``: its
    own ``hf/`` (config and tokenizer only), for a caller that needs no weights."""
    from pipeline.policy_store.delta import cache_keep, delta_only, materialize

    lake = as_lake(lake)
    cache_keep()        # a bad $PIPELINE_WEIGHTS_CACHE_KEEP fails here, before a command's work, not at its publish
    if isinstance(spec, str) and spec not in ("latest",) and not spec.isdigit():
        p = Path(spec)
        if p.is_dir():
            hf = p if (p / "config.json").exists() else p / HF_SUBDIR
            return PolicyRef(checkpoint_id=p.name, policy_version=-1, path=p, file_sha256={}, hf_path=hf)
    rows = checkpoint_rows(lake)
    if not rows:
        raise NotFoundError(f"no published policy in lake {lake.uri}", hint="run: pipeline policy init")
    if spec is None or spec == "latest":
        row = max(rows, key=lambda r: (r["policy_version"], r["created_at"]))
    elif isinstance(spec, int) or str(spec).isdigit():
        matches = [r for r in rows if r["policy_version"] == int(spec)]
        if not matches:
            raise NotFoundError(f"policy version {spec} is not published",
                                hint=f"published: {sorted({r['policy_version'] for r in rows})}")
        row = max(matches, key=lambda r: r["created_at"])
    else:
        matches = [r for r in rows if r["checkpoint_id"] == spec]
        if not matches:
            raise NotFoundError(f"checkpoint {spec} not found")
        row = matches[0]
    rel = row_rel(row)
    files = dict(row["file_sha256"])
    gone = retired_files(lake, row["checkpoint_id"], rel=rel)       # DeepSpeed state removed by retention
    if gone:
        files = {k: v for k, v in files.items() if k not in gone}
    local = fetch_checkpoint(lake, row["checkpoint_id"], files, rel=rel)
    key = (str(local), row["checkpoint_id"])
    if verify and _CHECKED.get(key) != (files, _stats(local, files)):
        # rehash only when the files changed since this process last verified them:
        # rollout workers following the newest policy resolve it every wave
        verify_dir(local, files, what=f"checkpoint {row['checkpoint_id']}")
        _CHECKED[key] = (files, _stats(local, files))
    rebuilt = materialize(lake, row, local / HF_SUBDIR, rows) if weights and delta_only(row) else None
    return PolicyRef(row["checkpoint_id"], int(row["policy_version"]), local, files, hf_path=rebuilt, rel=rel)


def fetch_checkpoint(lake: Lake, checkpoint_id: str, files: dict[str, str], *, rel: str | None = None) -> Path:
    """Make a checkpoint's files (directory ``rel``) available locally (no-op for a local lake)."""
    rel = rel or checkpoint_rel(checkpoint_id)
    local = local_dir(lake, rel)
    if lake.is_local:
        return local
    fs, root = lake.filesystem()
    for name, sha in files.items():
        dst = local / name
        if dst.exists() and hashlib.sha256(dst.read_bytes()).hexdigest() == sha:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(f"{root}/{rel}/{name}") as f:
            dst.write_bytes(f.read())
    return local


def upload_checkpoint(lake: Lake, checkpoint_id: str, local: Path, *, rel: str | None = None) -> None:
    """Copy a locally written checkpoint into directory ``rel`` of an object-store lake (no-op when local)."""
    if lake.is_local:
        return
    fs, root = lake.filesystem()
    rel = rel or checkpoint_rel(checkpoint_id)
    for p in sorted(local.rglob("*")):
        if p.is_file():
            dst = f"{root}/{rel}/{p.relative_to(local).as_posix()}"
            fs.create_dir(dst.rsplit("/", 1)[0], recursive=True)
            with fs.open_output_stream(dst) as f:
                f.write(p.read_bytes())


def discard_run_dir(lake: Lake, rel: str) -> None:
    """Delete an unpublished run directory (a loser's files: no row names them)."""
    import shutil

    shutil.rmtree(local_dir(lake, rel), ignore_errors=True)
    if not lake.is_local:
        fs, root = lake.filesystem()
        try:
            fs.delete_dir(f"{root}/{rel}")
        except (FileNotFoundError, OSError):
            pass


def published_by(row: dict[str, Any]) -> str:
    """Who published a row, in words (rows before this record: its command and time)."""
    try:
        who = json.loads(row.get("train_config_json") or "{}").get("published_by") or {}
    except ValueError:
        who = {}
    at = row.get("created_at")
    at_s = at.isoformat(timespec="seconds") if isinstance(at, datetime) else str(at or "?")
    if not who:
        return f"an earlier run (at {at_s})"
    return f"{who.get('command', '?')} on {who.get('host', '?')} pid {who.get('pid', '?')} (run {who.get('run', '?')}, at {at_s})"


POLICY_VERSION_APP = "pipeline.policy_version"  # its version = the newest published policy version + 1


def publish_checkpoint(lake: Lake, *, checkpoint_id: str, policy_version: int | None, parent_checkpoint_id: str | None,
                       snapshot_ids: list[str], train_config: dict[str, Any], train_config_hash: str,
                       seed: int, world_size: int = 1, global_step: int = 0, samples_seen: int = 0,
                       metrics: dict[str, Any] | None = None, command: str = "train", rel: str | None = None,
                       once_per_snapshot: bool = False) -> dict[str, Any]:
    """Hash every file of the (fully written) checkpoint directory ``rel`` (default:
    the legacy ``_checkpoints/<checkpoint_id>``; a training run passes its own,
    ``run_checkpoint_rel``) and append its row: from this commit on, the policy
    version is published, and the row's ``path`` names ``rel``.

    ``policy_version=None`` takes the next free version. Every checkpoints commit
    carries version v+1 of the application transaction ``pipeline.policy_version``,
    which delta-rs lets only one commit take, so the decisions below are made on
    the table as it is when the commit lands:

    - the checkpoint id is published already (by a racing run of the same id):
      nothing is committed, this run's directory is deleted, and the published row
      is returned with ``already_published`` and ``published_by``;
    - ``once_per_snapshot`` and another checkpoint consumed one of ``snapshot_ids``:
      ConflictError naming it (this run's directory deleted);
    - the version was taken: re-read and take the next one (with an explicit
      ``policy_version``, a ConflictError)."""
    from pipeline.lake.delta import pause_point

    rel = rel or checkpoint_rel(checkpoint_id)
    local = local_dir(lake, rel)
    if not (local / HF_SUBDIR / "config.json").exists():
        raise NotFoundError(f"checkpoint {checkpoint_id} has no {HF_SUBDIR}/config.json at {local}")
    files = hash_dir(local)
    upload_checkpoint(lake, checkpoint_id, local, rel=rel)
    # nothing published without its files (docs/write-protocol.md): each one is on the lake as hashed
    lake.check_files({f"{rel}/{name}": (local / name).stat().st_size for name in files},
                     what=f"publication of checkpoint {checkpoint_id}")
    pause_point("publish:files-written")       # kill tests: every file in place, no row
    who = {"command": command, "host": socket.gethostname(), "pid": os.getpid(), "run": rel.rsplit("/", 1)[-1]}
    row = {
        "checkpoint_id": checkpoint_id, "parent_checkpoint_id": parent_checkpoint_id,
        "snapshot_ids": list(snapshot_ids), "policy_version": -1, "path": rel,
        "train_config_hash": train_config_hash,
        "train_config_json": json.dumps(train_config | {"published_by": who}, sort_keys=True, default=str),
        "code_version": code_version(), "seed": int(seed), "world_size": int(world_size),
        "global_step": int(global_step), "samples_seen": int(samples_seen),
        "metrics_json": json.dumps(metrics or {}, sort_keys=True, default=str),
        "file_sha256": list(files.items()), "created_at": datetime.now(timezone.utc),
    }
    return _land_row(lake, row, policy_version=policy_version, once_per_snapshot=once_per_snapshot, command=command)


def _settled(lake: Lake, rel: str, winner: dict[str, Any]) -> dict[str, Any]:
    """The outcome when ``winner`` holds the checkpoint id: our own commit (an earlier
    try of this call), or another run's (ours lost: no row names our files, deleted)."""
    if row_rel(winner) == rel:
        return dict(winner) | {"already_published": False, "published_by": None}
    discard_run_dir(lake, rel)
    return dict(winner) | {"already_published": True, "published_by": published_by(winner)}


def _land_row(lake: Lake, row: dict[str, Any], *, policy_version: int | None, once_per_snapshot: bool,
              command: str) -> dict[str, Any]:
    """Append ``row`` under the next free (or the given) policy version: ``publish_checkpoint``'s commit loop."""
    from pipeline.errors import ConflictError
    from pipeline.lake.delta import LockTaken, pause_point
    from pipeline.schema import arrow_schema

    checkpoint_id, rel, snapshot_ids = row["checkpoint_id"], row["path"], row["snapshot_ids"]
    for _ in range(100):
        rows = checkpoint_rows(lake)
        prior = [r for r in rows if r["checkpoint_id"] == checkpoint_id]
        if prior:
            return _settled(lake, rel, prior[0])
        taken = [r for r in rows if set(r["snapshot_ids"] or []) & set(snapshot_ids)] if once_per_snapshot else []
        if taken:
            discard_run_dir(lake, rel)
            t = taken[0]
            raise ConflictError(f"snapshot {', '.join(snapshot_ids)} was consumed by checkpoint "
                                f"{t['checkpoint_id']} (policy version {t['policy_version']}), published by "
                                f"{published_by(t)} while this run trained; this run's files were discarded",
                                hint="a snapshot trains once; pass --force to train on it again")
        latest = max((r["policy_version"] for r in rows), default=None)
        version = int(policy_version) if policy_version is not None else (0 if latest is None else latest + 1)
        row["policy_version"] = version
        table = pa.Table.from_pylist([row], schema=arrow_schema("checkpoints"))
        try:
            # exactly once per checkpoint id, even if the publisher is retried
            res = lake.append("checkpoints", table, command=command, config_hash=row["train_config_hash"],
                              app_id=f"publish:{checkpoint_id}", txn_version=0,
                              lock=(POLICY_VERSION_APP, version + 1))
        except LockTaken:
            if policy_version is not None:
                holders = [r for r in checkpoint_rows(lake) if r["policy_version"] == version]
                if holders and holders[0]["checkpoint_id"] == checkpoint_id:
                    return _settled(lake, rel, holders[0])
                raise ConflictError(f"policy version {version} is already published (checkpoint "
                                    f"{holders[0]['checkpoint_id'] if holders else '?'})",
                                    hint="publish as the next version, or use the published one") from None
            continue
        if not res.landed:  # this checkpoint id was published meanwhile (or by an earlier try of ours)
            prior = [r for r in checkpoint_rows(lake) if r["checkpoint_id"] == checkpoint_id]
            if prior:
                return _settled(lake, rel, prior[0])
        pause_point("publish:committed")        # kill tests: the row landed
        return row | {"already_published": False, "published_by": None}
    raise ConflictError("could not take a policy version: other publishers kept winning", hint="rerun")


# -- bring your own model: tokenizer revisions, import, listing -------------------------------
# The files that define a tokenizer (whichever of them a model directory has): what import copies.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "vocab.txt")
# The parts of tokenizer.json's pipeline that decide which ids a text gets and which text ids decode to.
# Not "padding"/"truncation": a tokenizer once called with padding=True saves them, and they change no id.
_PIPELINE_KEYS = ("normalizer", "pre_tokenizer", "model", "post_processor", "decoder")
TOKENIZER_REV_FORMAT = "tok2"       # bumps if the canonical form below ever changes


def _canonical_merges(model: dict[str, Any]) -> dict[str, Any]:
    """tokenizers writes BPE merges as "a b" strings (older) or [a, b] pairs (newer): one form."""
    if isinstance(model.get("merges"), list):
        model = dict(model)
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model["merges"]]
    return model


def tokenizer_canonical(tok: Any) -> dict[str, Any]:
    """The content that defines a loaded transformers tokenizer, as plain JSON
    (see docs/how-to/own-model.md "Bring your own model" for the spec an external producer follows):

    - ``vocab``: every token string in id order (``tok.get_vocab()``, added tokens included);
    - ``pipeline``: the ``normalizer``, ``pre_tokenizer``, ``model`` (type, vocab, merges as
      [a, b] pairs, ...), ``post_processor`` and ``decoder`` objects of the fast tokenizer's
      ``tokenizer.json`` (``tok.backend_tokenizer.to_str()``), padding and truncation left out;
    - ``added_tokens``: [content, id, special] of each added token, by id;
    - ``special``: the bos/eos/unk/pad token strings (null when unset);
    - ``chat_template``: ``tok.chat_template`` (null when none).
    """
    backend = json.loads(tok.backend_tokenizer.to_str()) if getattr(tok, "backend_tokenizer", None) else {}
    pipeline = {k: backend.get(k) for k in _PIPELINE_KEYS}
    if isinstance(pipeline["model"], dict):
        pipeline["model"] = _canonical_merges(pipeline["model"])
    added = sorted(([a["content"], int(a["id"]), bool(a.get("special"))] for a in backend.get("added_tokens") or []),
                   key=lambda a: a[1])
    by_id = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return {"format": TOKENIZER_REV_FORMAT, "vocab": [t for t, _ in by_id], "pipeline": pipeline,
            "added_tokens": added,
            "special": {k: getattr(tok, f"{k}_token", None) for k in ("bos", "eos", "unk", "pad")},
            "chat_template": getattr(tok, "chat_template", None)}


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8 (non-ASCII kept as is): the bytes every rev hashes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def tokenizer_rev(hf_dir: str | Path) -> str:
    """The tokenizer revision of a model directory: ``vocab.TOKENIZER_REV`` for the
    built-in char tokenizer (its vocabulary is the char table), otherwise
    ``tok-`` + the first 16 hex digits of sha256(canonical_json(tokenizer_canonical(tok)))
    for the tokenizer transformers loads from the directory. The content, not the
    file bytes: the same tokenizer saved again (by another transformers version,
    after a ``padding=True`` call, with reordered JSON keys) keeps its rev. A
    trained version copies its parent's tokenizer files, so it keeps its parent's rev."""
    from pipeline import vocab

    d = Path(hf_dir)
    tj = d / "tokenizer.json"
    if tj.is_file():
        try:
            model = json.loads(tj.read_text()).get("model") or {}
            if model.get("type") == "WordLevel" and model.get("vocab") == {t: i for i, t in enumerate(vocab.TOKENS)}:
                return vocab.TOKENIZER_REV
        except (ValueError, OSError):
            pass
    if not any((d / name).is_file() for name in TOKENIZER_FILES):
        raise NotFoundError(f"{d}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)",
                            hint="save the tokenizer next to the model: tokenizer.save_pretrained(DIR)")
    key = str(d.resolve()), tuple(_stats(d, {n: "" for n in TOKENIZER_FILES}).items())
    if key not in _TOKENIZER_REVS:          # loading a 50k-token tokenizer takes ~0.5 s: once per process and files
        from pipeline.errors import InputFileError

        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(d))
        except Exception as exc:  # noqa: BLE001 - any failure to load is a bad tokenizer directory
            raise InputFileError(f"{d}: transformers cannot load its tokenizer: {type(exc).__name__}: "
                                 f"{str(exc)[:200]}", hint="save it with tokenizer.save_pretrained(DIR)") from None
        _TOKENIZER_REVS[key] = "tok-" + hashlib.sha256(canonical_json(tokenizer_canonical(tok))).hexdigest()[:16]
    return _TOKENIZER_REVS[key]


_TOKENIZER_REVS: dict[tuple, str] = {}


def _origin(row: dict[str, Any]) -> str:
    try:
        kind = json.loads(row.get("train_config_json") or "{}").get("kind")
    except ValueError:
        kind = None
    return {"warm_start": "init", "import": "import"}.get(kind, "train")


def list_policies(lake: Lake | str | os.PathLike[str]) -> list[dict[str, Any]]:
    """One row per published version: version, checkpoint id, origin (init /
    import / train), tokenizer_rev, parent, architecture, created_at, path (its directory)."""
    lake = as_lake(lake)
    if not lake.exists("checkpoints"):
        return []
    t = lake.read("checkpoints", columns=["checkpoint_id", "policy_version", "parent_checkpoint_id",
                                          "train_config_json", "created_at", "path"])
    out = []
    for r in sorted(t.to_pylist(), key=lambda r: (r["policy_version"], r["created_at"])):
        cfg = json.loads(r["train_config_json"] or "{}")
        hf = local_dir(lake, row_rel(r)) / HF_SUBDIR
        rev = cfg.get("tokenizer_rev")
        arch = cfg.get("model_type")
        if rev is None or arch is None:
            try:
                rev = rev or tokenizer_rev(hf)
                arch = arch or json.loads((hf / "config.json").read_text()).get("model_type")
            except (OSError, ValueError, NotFoundError):
                pass
        out.append({"policy_version": int(r["policy_version"]), "checkpoint_id": r["checkpoint_id"],
                    "origin": _origin(r), "tokenizer_rev": rev, "model_type": arch,
                    "parent_checkpoint_id": r["parent_checkpoint_id"], "created_at": r["created_at"].isoformat(),
                    "path": row_rel(r)})
    return out


def policy_info(lake: Lake, policy_version: int) -> dict[str, Any] | None:
    """The ``list_policies`` row of one version (None when not published)."""
    rows = [r for r in list_policies(lake) if r["policy_version"] == int(policy_version)]
    return rows[-1] if rows else None


def check_model_dir(hf_dir: str | Path) -> dict[str, Any]:
    """Refuse a directory the engines and the trainer could not use, before anything
    is written: config and tokenizer load, the weights are safetensors and load
    into the architecture the config names (every parameter present, right shapes),
    and one forward pass gives finite logits over the config's vocabulary. Returns
    {config, tokenizer_rev} for ``import_policy``. Raises InputFileError naming what to fix."""
    from pipeline.errors import InputFileError

    src = Path(hf_dir)
    if not (src / "config.json").is_file():
        raise InputFileError(f"{src}: not a Hugging Face model directory (no config.json)",
                             hint="pass the directory model.save_pretrained() wrote")
    weights = sorted(p.name for p in src.iterdir() if p.name.endswith(".safetensors")
                     or p.name == "model.safetensors.index.json")
    if not weights:
        raise InputFileError(f"{src}: no *.safetensors weights",
                             hint="save with model.save_pretrained(DIR, safe_serialization=True); "
                                  "pickled .bin weights are not imported")
    try:
        from transformers import AutoConfig, AutoTokenizer

        config = AutoConfig.from_pretrained(str(src))
        tok = AutoTokenizer.from_pretrained(str(src))
    except Exception as exc:  # noqa: BLE001 - any failure to load is a bad input directory
        raise InputFileError(f"{src}: transformers cannot load it: {type(exc).__name__}: {str(exc)[:200]}",
                             hint="the directory needs config.json and the tokenizer files") from None
    if getattr(config, "vocab_size", None) is not None and len(tok) > int(config.vocab_size):
        raise InputFileError(f"{src}: the tokenizer has {len(tok)} tokens, the model's vocabulary {config.vocab_size}",
                             hint="resize the embeddings (model.resize_token_embeddings) before saving")
    if tok.eos_token_id is None:
        raise InputFileError(f"{src}: the tokenizer has no eos token", hint="set tokenizer.eos_token and save it again")
    _check_weights_load(src, config, int(tok.eos_token_id))
    return {"config": config, "tokenizer_rev": tokenizer_rev(src)}


def _check_weights_load(src: Path, config: Any, token_id: int) -> None:
    """Load the weights as the config's architecture and run one forward pass."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from pipeline.errors import InputFileError

    hf_logging.disable_progress_bar()
    fix = "re-save the model with model.save_pretrained(DIR, safe_serialization=True) (a copy may be truncated)"
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, output_loading_info=True)
    except Exception as exc:  # noqa: BLE001 - a truncated/corrupt file, a wrong architecture: all bad input
        raise InputFileError(f"{src}: the weights do not load: {type(exc).__name__}: {str(exc)[:300]}",
                             hint=fix) from None
    missing = sorted(info.get("missing_keys") or [])
    bad = [str(x) for x in info.get("mismatched_keys") or []]
    if missing or bad:
        raise InputFileError(f"{src}: the weights do not fit its {type(model).__name__} config: "
                             f"missing {missing[:4]}, mismatched {bad[:4]}", hint=fix)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[token_id, token_id]])).logits           # [1, 2, V]
    if logits.shape[-1] < int(getattr(config, "vocab_size", 0) or 0) or not bool(torch.isfinite(logits).all()):
        raise InputFileError(f"{src}: one forward pass gave {'non-finite' if logits.numel() else 'no'} logits "
                             f"(shape {tuple(logits.shape)})", hint=fix)


def import_policy(lake: Lake | str | os.PathLike[str], hf_dir: str | Path, *, checked: dict[str, Any] | None = None,
                  source: dict[str, Any] | None = None) -> dict[str, Any]:
    """Register a Hugging Face causal LM directory as the next policy version.

    Checks the directory first (``check_model_dir``: config, tokenizer,
    safetensors weights that load into the config's architecture, one finite
    forward pass; ``checked`` is its result when the caller already ran it),
    copies the model, config and tokenizer files into
    ``<lake>/_checkpoints/import-<hash>/hf/`` and publishes them (every file
    hashed). Idempotent: importing the same files again returns the version they
    already have. ``source`` is recorded in the version's train config (the GGUF
    import names its file there)."""
    lake = as_lake(lake)
    import shutil

    src = Path(hf_dir)
    info = checked if checked is not None else check_model_dir(src)
    config, rev = info["config"], info["tokenizer_rev"]
    keep = [p for p in sorted(src.iterdir()) if p.is_file() and not p.name.endswith((".bin", ".pt", ".pth", ".pkl"))]
    h = hashlib.sha256()
    for p in keep:
        h.update(p.name.encode() + b"\x00" + hashlib.sha256(p.read_bytes()).digest())
    content = h.hexdigest()
    ckpt_id = f"import-{content[:16]}"
    prior = [r for r in checkpoint_rows(lake) if r["checkpoint_id"] == ckpt_id]
    if not prior:
        rel = run_checkpoint_rel(ckpt_id)              # this import's own directory
        root = local_dir(lake, rel)
        (root / HF_SUBDIR).mkdir(parents=True)
        for p in keep:
            shutil.copy2(p, root / HF_SUBDIR / p.name)
        train_cfg = {"kind": "import", "source": str(src.resolve()), "content_sha256": content,
                     "tokenizer_rev": rev, "model_type": config.model_type,
                     "architectures": list(getattr(config, "architectures", None) or [])} | (source or {})
        row = publish_checkpoint(lake, checkpoint_id=ckpt_id, policy_version=None, parent_checkpoint_id=None,
                                 snapshot_ids=[], train_config=train_cfg, train_config_hash=content, seed=0,
                                 command="pipeline policy import", rel=rel)
        if row["already_published"]:            # a concurrent import of the same files won
            prior = [row]
    else:
        row = prior[0]
    version = int(row["policy_version"])
    return {"policy_version": version, "checkpoint_id": ckpt_id, "tokenizer_rev": rev,
            "model_type": config.model_type, "path": str(local_dir(lake, row_rel(row)) / HF_SUBDIR),
            "already_present": bool(prior)}


def policy_train_config(lake: Lake, ref: PolicyRef) -> dict[str, Any]:
    """The train config a published policy recorded ({} for a plain directory)."""
    if ref.policy_version < 0 or not lake.exists("checkpoints"):
        return {}
    import pyarrow.dataset as ds

    t = lake.read("checkpoints", columns=["train_config_json"], filter=ds.field("checkpoint_id") == ref.checkpoint_id)
    rows = t.column("train_config_json").to_pylist()
    return json.loads(rows[0] or "{}") if rows else {}


# -- checkpoint retention ---------------------------------------------------------------------
RETIRED_FILE = "retired.json"      # in a checkpoint directory: the DeepSpeed files retention removed
RETIRABLE = ("ds/", "rng/")         # never hf/: the exported model every lineage query points to


def retired_files(lake: Lake, checkpoint_id: str, *, rel: str | None = None) -> set[str]:
    """The files of a published checkpoint (directory ``rel``) that retention removed (verification skips them)."""
    fs, root = lake.filesystem()
    try:
        with fs.open_input_stream(f"{root}/{rel or checkpoint_rel(checkpoint_id)}/{RETIRED_FILE}") as f:
            return set(json.loads(f.read().decode()).get("removed", []))
    except (FileNotFoundError, OSError, ValueError):
        return set()


# public names of the sub-modules (imported last: they use the names above)
from pipeline.policy_store.care import retire_checkpoints, verify_checkpoints  # noqa: E402,F401
from pipeline.policy_store.gguf import converted_gguf, gguf_to_hf_dir, import_gguf  # noqa: E402,F401
