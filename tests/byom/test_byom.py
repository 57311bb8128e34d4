"""Bring your own model: import an HF causal LM (tiny qwen2 + BPE, built here),
roll out with its tokenizer, admit, train, reload; foreign tokenizers refused;
checkpoint retention."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def cli(lake, *args, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "pipeline", *args, "--lake", str(lake.uri)], capture_output=True,
                       text=True, env=env, timeout=600)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_import_list_and_idempotence(lake, qwen2_dir, tmp_path):
    from pipeline.policy_store import tokenizer_rev

    p = cli(lake, "policy", "import", "--hf-dir", str(qwen2_dir), "--json")
    r = json.loads(p.stdout)
    assert r["policy_version"] == 0 and r["tokenizer_rev"] == tokenizer_rev(qwen2_dir)
    assert r["tokenizer_rev"].startswith("tok-") and r["model_type"] == "qwen2"
    again = json.loads(cli(lake, "policy", "import", "--hf-dir", str(qwen2_dir), "--json").stdout)
    assert again["policy_version"] == 0 and again["already_present"]
    rows = json.loads(cli(lake, "policy", "list", "--json").stdout)["policies"]
    assert [(x["policy_version"], x["origin"], x["tokenizer_rev"]) for x in rows] == [(0, "import", r["tokenizer_rev"])]
    text = cli(lake, "policy", "list").stdout
    assert "import" in text and r["tokenizer_rev"] in text
    # the copy in the lake is hash-verified like any published version
    from pipeline.policy_store import resolve_policy

    ref = resolve_policy(lake, 0)
    assert (ref.hf_dir / "tokenizer.json").is_file() and ref.file_sha256
    # a directory that is not a model: one error line, exit 2
    (tmp_path / "empty").mkdir()
    bad = cli(lake, "policy", "import", "--hf-dir", str(tmp_path / "empty"), check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "config.json" in bad.stderr


def test_stop_strings_are_found_across_bpe_merges():
    from pipeline.rollout.codec import cut_at_stop, parse_turn

    class Merged:          # a tokenizer that merged "</call>" with its neighbours: no token is "</call>"
        char = False
        eos_id = 0
        pieces = {0: "<eos>", 1: "<ca", 2: "ll>3", 3: "7*4", 4: "5</c", 5: "all>1", 6: "9"}

        def decode(self, ids):
            return "".join(self.pieces[i] for i in ids)

    c = Merged()
    turn = [1, 2, 3, 4, 5, 6, 6]
    k = cut_at_stop(c, turn, ("</call>",))
    assert k == 5                                          # the token that completes the stop string
    assert parse_turn(c, turn[:k]) == ("37*45", None)      # text after the stop string in that token is ignored
    assert cut_at_stop(c, [1, 2, 3], ("</call>",)) is None


@pytest.mark.slow
def test_imported_qwen2_rollout_admit_train_reload(lake, qwen2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.policy_store import resolve_policy
    from pipeline.rollout.run import RolloutConfig, run_rollout
    from pipeline.train.config import TrainConfig
    from pipeline.train.run import train_snapshot

    imp = json.loads(cli(lake, "policy", "import", "--hf-dir", str(qwen2_dir), "--json").stdout)
    s = run_rollout(lake, RolloutConfig(env="arithmetic-tool", groups=3, group_size=3, seed=1, run_id="byom",
                                        spool_fsync=False, max_tokens_per_turn=12, max_total_tokens=40))
    assert s.trajectories == 9
    rows = lake.read("trajectories").to_pylist()
    tok = AutoTokenizer.from_pretrained(str(qwen2_dir))
    assert {r["tokenizer_rev"] for r in rows} == {imp["tokenizer_rev"]}
    for r in rows:       # prompts are in the policy's tokenizer: they decode back to the task text
        assert tok.decode(r["prompt_ids"]).endswith("=")
        assert max(r["prompt_ids"] + r["response_ids"]) < len(tok)
        assert len(r["response_ids"]) == len(r["loss_mask"]) == len(r["response_logprobs"])
    # a random model rarely answers right: admit zero-spread groups too, so training has members
    adm = admit(lake, AdmissionConfig(drop_zero_variance=False, min_reward_std=0.0))
    assert adm.snapshot_id and adm.admitted_members > 0
    res = train_snapshot(lake, adm.snapshot_id, TrainConfig(lr=1e-3, micro_batch_tokens=512), progress=False)
    assert res.policy_version == 1
    ref = resolve_policy(lake, 1)
    m = AutoModelForCausalLM.from_pretrained(str(ref.hf_dir))
    assert type(m).__name__ == "Qwen2ForCausalLM" and m.config.vocab_size == len(tok)
    rows = json.loads(cli(lake, "policy", "list", "--json").stdout)["policies"]
    assert [(x["origin"], x["tokenizer_rev"]) for x in rows] == [("import", imp["tokenizer_rev"])] * 1 + [
        ("train", imp["tokenizer_rev"])]
    # the trained version rolls out with the same tokenizer
    s2 = run_rollout(lake, RolloutConfig(env="reverse-digits", groups=1, group_size=2, seed=2, run_id="byom2",
                                         spool_fsync=False, max_tokens_per_turn=8, max_total_tokens=16))
    assert s2.policy_versions == [1]


def _with(t, **cols):
    """``t`` with columns set to one value, content hashes recomputed."""
    import pyarrow as pa

    from pipeline.lake.contenthash import content_hashes

    for name, value in cols.items():
        t = t.set_column(t.schema.get_field_index(name), name, pa.array([value] * t.num_rows))
    i = t.schema.get_field_index("content_hash")
    return t.set_column(i, t.schema.field(i), content_hashes(t.drop_columns(["content_hash"])))


def _synth_lake(lake, tmp_path, n=32, **kw):
    import pyarrow.parquet as pq

    from pipeline.ingest import ingest_files
    from pipeline.testing.trajectories import make_trajectories

    t = make_trajectories(n, seed=2, median_len=12, prompt_len=4, **kw)
    f = tmp_path / f"t-{kw.get('run_id', 'run-0')}.parquet"
    pq.write_table(t, f)
    ingest_files(lake, [f])
    return t


def test_foreign_tokenizer_snapshot_is_refused(lake, qwen2_dir, tmp_path):
    from pipeline.admission.run import admit
    from pipeline.testing.train_fixtures import publish_tiny_policy

    publish_tiny_policy(lake, vocab_size=30000, hidden_size=16, intermediate_size=32)   # v0, tokenizer "tok-1"
    _synth_lake(lake, tmp_path)
    adm = admit(lake)
    assert adm.snapshot_id
    cli(lake, "policy", "import", "--hf-dir", str(qwen2_dir))                            # v1, the BPE tokenizer
    p = cli(lake, "train", "--batch-snapshot", adm.snapshot_id, "--from-checkpoint", "1", "--no-progress",
            check=False)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "tokenizer tok-1" in p.stderr
    assert len([x for x in p.stderr.splitlines() if x.startswith("error:")]) == 1


def test_prompt_template_revision_the_policy_was_not_trained_with(lake, tmp_path):
    from pipeline.admission.run import admit
    from pipeline.errors import PipelineError
    from pipeline.policy_store import resolve_policy
    from pipeline.train.data import check_comparable
    from pipeline.testing.train_fixtures import publish_tiny_policy

    import pyarrow.parquet as pq

    from pipeline.ingest import ingest_files
    from pipeline.testing.trajectories import make_trajectories

    publish_tiny_policy(lake, vocab_size=30000, hidden_size=16, intermediate_size=32)
    t = make_trajectories(32, seed=2, median_len=12, prompt_len=4)
    t = _with(t, prompt_template_rev="expr=/2")                  # revisions are "<template>/<rev>"
    pq.write_table(t, tmp_path / "t.parquet")
    ingest_files(lake, [tmp_path / "t.parquet"])
    adm = admit(lake)
    ref = resolve_policy(lake, 0)
    # not recorded, or another template: comparable
    for known in (None, ["r:digits=/1"], ["expr=/1", "expr=/2"]):
        assert check_comparable(lake, adm.snapshot_id, policy_tokenizer="tok-1", policy_templates=known,
                                policy_name="v0")["prompt_template_rev"] == {"expr=/2"}
    with pytest.raises(PipelineError, match="expr=/2.*trained with expr=/1"):
        check_comparable(lake, adm.snapshot_id, policy_tokenizer="tok-1", policy_templates=["expr=/1"],
                         policy_name=ref.checkpoint_id)


def test_admission_keeps_one_tokenizer_and_scopes(lake, tmp_path):

    import pyarrow.parquet as pq

    from pipeline.admission.run import admit
    from pipeline.admission.scope import Scope
    from pipeline.ingest import ingest_files
    from pipeline.testing.trajectories import make_trajectories
    from pipeline.testing.train_fixtures import publish_tiny_policy

    publish_tiny_policy(lake, vocab_size=30000, hidden_size=16, intermediate_size=32)   # tokenizer "tok-1"
    a = make_trajectories(24, seed=2, median_len=12, prompt_len=4, run_id="run-a", id_prefix="a")
    b = make_trajectories(40, seed=3, median_len=12, prompt_len=4, run_id="run-b", id_prefix="b")
    b = _with(b, tokenizer_rev="tok-other")
    c = make_trajectories(16, seed=4, median_len=12, prompt_len=4, run_id="run-c", id_prefix="c")
    for name, t in (("a", a), ("b", b), ("c", c)):
        pq.write_table(t, tmp_path / f"{name}.parquet")
    ingest_files(lake, [tmp_path / "a.parquet", tmp_path / "b.parquet", tmp_path / "c.parquet"])

    # scoped: only run-c's groups are decided
    r1 = admit(lake, scope=Scope(run_id="run-c"))
    assert set(r1.receipts.column("run_id").to_pylist()) == {"run-c"}
    # the rest: run-b's groups (another tokenizer, even though the majority) are deferred, not decided:
    # no policy of their tokenizer is current yet, and deciding them now would close them for good
    r2 = admit(lake)
    rec = r2.receipts.to_pylist()
    assert {x["run_id"] for x in rec} == {"run-a"}
    assert r2.quality["deferred_groups"] == {"tok-other": len(set(b.column("group_id").to_pylist()))}
    assert r2.snapshot_id
    snap_ids = set(r2.members.column("trajectory_id").to_pylist())
    assert snap_ids and all(t.startswith("a") for t in snap_ids)
    p = cli(lake, "admit")
    assert "of tokenizer tok-other left undecided: they wait for a policy of that tokenizer" in p.stdout, p.stdout
    # once a policy of their tokenizer is current, they are decided (and admitted) like any group
    publish_tiny_policy(lake, checkpoint_id="tiny-other", vocab_size=30000, hidden_size=16, intermediate_size=32,
                        tokenizer_rev="tok-other")
    r3 = admit(lake)
    assert {x["run_id"] for x in r3.receipts.to_pylist()} == {"run-b"} and not r3.quality["deferred_groups"]
    assert r3.snapshot_id and all(t.startswith("b") for t in r3.members.column("trajectory_id").to_pylist())
    # the CLI takes the scope options
    p = cli(lake, "admit", "--run-id", "nothing-here", "--json")
    assert json.loads(p.stdout)["snapshot_id"] is None


def test_checkpoint_retention_keeps_hf_and_newest_states(lake):
    from pipeline.maintain import maintain
    from pipeline.lineage import walk
    from pipeline.policy_store import local_checkpoint_dir, publish_checkpoint, resolve_policy, retired_files
    from pipeline.testing.train_fixtures import publish_tiny_policy

    publish_tiny_policy(lake, hidden_size=16, intermediate_size=32)
    parent = "tiny-v0"
    ids = []
    for v in (1, 2, 3):        # versions laid out as the trainer publishes them: hf/ + ds/ + rng/
        cid = f"ck-{v}"
        root = local_checkpoint_dir(lake, cid)
        src = local_checkpoint_dir(lake, parent) / "hf"
        (root / "hf").mkdir(parents=True)
        for f in src.iterdir():
            (root / "hf" / f.name).write_bytes(f.read_bytes())
        (root / "ds" / "final").mkdir(parents=True)
        (root / "ds" / "final" / "optim_states.pt").write_bytes(os.urandom(4096))
        (root / "rng" / "final").mkdir(parents=True)
        (root / "rng" / "final" / "rank0.pt").write_bytes(b"rng")
        (root / "latest").write_text("final")
        publish_checkpoint(lake, checkpoint_id=cid, policy_version=None, parent_checkpoint_id=parent,
                           snapshot_ids=[], train_config={}, train_config_hash="x", seed=0)
        ids.append(cid)
        parent = cid
    # an interrupted run training from ck-1: its parent's state stays
    run = local_checkpoint_dir(lake, "_runs/abc")
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"parent_checkpoint_id": "ck-1"}))

    dry = maintain(lake, keep_checkpoints=1, dry_run=True, tables=["checkpoints"])["checkpoints"]
    assert [x["checkpoint_id"] for x in dry["retired"]] == ["ck-2"]
    assert (local_checkpoint_dir(lake, "ck-2") / "ds").is_dir()           # dry run changes nothing
    p = cli(lake, "lake", "maintain", "--set", "keep_checkpoints=1", "--table", "checkpoints", "--json")
    rep = json.loads(p.stdout)["checkpoints"]
    assert [x["checkpoint_id"] for x in rep["retired"]] == ["ck-2"] and rep["files_removed"] == 2
    assert not (local_checkpoint_dir(lake, "ck-2") / "ds").exists()
    assert retired_files(lake, "ck-2") == {"ds/final/optim_states.pt", "rng/final/rank0.pt"}
    for cid in ("ck-1", "ck-3"):
        assert (local_checkpoint_dir(lake, cid) / "ds" / "final" / "optim_states.pt").is_file()
    # every version still resolves (hash-verified) and its hf/ export is there for lineage
    for v in (0, 1, 2, 3):
        ref = resolve_policy(lake, v)
        assert (ref.hf_dir / "model.safetensors").is_file()
    assert walk(lake, "ck-2")
    # the run finished: now ck-1 goes too; a second pass is a no-op
    (run / "run.json").unlink()
    rep = maintain(lake, keep_checkpoints=1, tables=["checkpoints"])["checkpoints"]
    assert [x["checkpoint_id"] for x in rep["retired"]] == ["ck-1"]
    assert maintain(lake, keep_checkpoints=1, tables=["checkpoints"])["checkpoints"]["retired"] == []
    resolve_policy(lake, 1)


def test_eval_runs_an_imported_model(lake, qwen2_dir):
    """The CLI's evaluation of an imported model is the greedy evaluation recomputed in this process:
    equal figures (success, format, tool use, statuses), every task judged or given a status."""
    from pipeline.rollout.evaluate import evaluate

    p = cli(lake, "policy", "eval", "--policy", str(qwen2_dir), "--env", "reverse-digits", "--n", "3", "--json")
    r = json.loads(p.stdout)
    again = evaluate(str(qwen2_dir), "reverse-digits", n=3)
    figures = ("n", "judged", "success_rate", "format_rate", "tool_use_rate", "reward_mean", "statuses",
               "success_by_difficulty", "prompt_template_rev", "render")
    assert {k: r[k] for k in figures} == {k: again[k] for k in figures}
    assert r["n"] == sum(r["statuses"].values()) == 3 and r["judged"] >= 1


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_engine_loads_an_imported_model(lake, qwen2_dir):
    from pipeline.rollout.run import RolloutConfig, run_rollout

    cli(lake, "policy", "import", "--hf-dir", str(qwen2_dir))
    s = run_rollout(lake, RolloutConfig(env="arithmetic-tool", engine="vllm", groups=2, group_size=2, seed=1,
                                        run_id="byom-vllm", spool_fsync=False, max_tokens_per_turn=8,
                                        max_total_tokens=24))
    assert s.trajectories == 4
    rows = lake.read("trajectories").to_pylist()
    assert all(len(r["response_ids"]) == len(r["response_logprobs"]) for r in rows)


def test_harness_multi_turn_with_a_bpe_tokenizer(lake, qwen2_dir):
    """A scripted engine answers in the BPE tokenizer's ids: the call stops at the decoded
    ``</call>`` (extra tokens after it are cut), the observation is encoded with the same
    tokenizer, and ``<ans>N`` + eos is a correct answer."""
    from pipeline.rollout import codec as codecs
    from pipeline.rollout.engine import Completion, Sampling
    from pipeline.rollout.envs import get_env
    from pipeline.rollout.harness import Harness
    from pipeline.rollout.spool import Spool, ship

    c = codecs.load(qwen2_dir)
    env = get_env("arithmetic-tool")
    task = env.reset(0)
    call = c.encode(f"<call>{task.meta['expr']}</call>") + c.encode("<ans>1")     # sampled past the stop string
    answer = c.encode(f"<ans>{task.answer}") + [c.eos_id]

    class Scripted:
        name, hf_dir = "scripted", qwen2_dir
        seen: list = []

        def generate(self, requests, sampling):
            assert sampling.stop_ids == (c.eos_id,)
            out = []
            for r in requests:
                self.seen.append(list(r.context))
                ids = call if len(self.seen) == 1 else answer
                out.append([Completion(list(ids), [-0.5] * len(ids), "stop" if ids[-1] == c.eos_id else "length")])
            return out

        def close(self):
            pass

    eng = Scripted()
    spool = Spool(lake.uri + "/_spool", "w", fsync=False)
    h = Harness(env, lambda: (eng, 0), spool, run_id="bpe", worker_id="w", sampling=Sampling(max_new_tokens=40),
                codec=c)
    (ep,) = h.run([h.new_episode(episode_id="e", group_id="g", group_size=1, task=task, seed=0, policy_version=0)])
    assert ep.status == "ACCEPTED" and ep.verdict == "PASS" and ep.tool_calls == 1, (ep.status, ep.stop_reason)
    n_call = codecs.cut_at_stop(c, call, ("</call>",))
    assert n_call < len(call) and c.decode(call[:n_call]).endswith("</call>")
    obs = c.encode(f"<obs>{task.answer}</obs>")
    assert ep.prompt_ids == c.encode(task.prompt)
    assert ep.response_ids == call[:n_call] + obs + answer
    assert ep.mask == [1] * n_call + [0] * len(obs) + [1] * len(answer)
    assert eng.seen[1] == ep.prompt_ids + call[:n_call] + obs       # the second turn saw the observation
    rep = ship(lake, spool)
    assert rep.trajectories == 1 and rep.quarantined == 0
    assert lake.read("trajectories").column("tokenizer_rev").to_pylist() == [c.rev]
