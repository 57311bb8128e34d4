"""Engines: log-probs of sampled tokens agree with a teacher-forced forward pass;
per-sample seeds make samples reproducible and independent of the batch."""

from __future__ import annotations

import pytest

from pipeline import vocab
from pipeline.rollout.engine import Request, Sampling

PROMPTS = ["37*45=", "12+88=", "r:40213=", "91-17="]


def _requests(n=3):
    return [Request(tuple([vocab.BOS_ID] + vocab.encode(p)), n=n, seed=100 + k) for k, p in enumerate(PROMPTS)]


def _check_agreement(engine, model, requests, sampling, tol=1e-4):
    from pipeline.rollout.hf import teacher_forced_logprobs

    out = engine.generate(requests, sampling)
    assert [len(cs) for cs in out] == [r.n for r in requests]
    checked = 0
    for r, cs in zip(requests, out):
        for c in cs:
            assert len(c.token_ids) == len(c.logprobs) >= 1
            ref = teacher_forced_logprobs(model, list(r.context), c.token_ids)
            assert max(abs(a - b) for a, b in zip(ref, c.logprobs)) < tol
            assert all(lp <= 0 for lp in c.logprobs)
            if c.finish == "stop":
                assert c.token_ids[-1] in sampling.stop_ids
            checked += len(c.token_ids)
    return out, checked


def test_hf_logprobs_match_forward_pass(policy_dir):
    from pipeline.rollout.hf import HFEngine, load_model

    eng = HFEngine(policy_dir, threads=1)
    model = load_model(policy_dir)
    # first turns (mixed prompt lengths: left padding) and a multi-turn continuation context
    cont = vocab.encode("<bos>37*45=<call>37*45</call><obs>1665</obs>")
    reqs = _requests() + [Request(tuple(cont), n=2, seed=7)]
    _, checked = _check_agreement(eng, model, reqs, Sampling(temperature=1.0, max_new_tokens=12))
    assert checked > 20


def test_hf_samples_depend_only_on_their_seed(policy_dir):
    from pipeline.rollout.hf import HFEngine

    eng = HFEngine(policy_dir, threads=1)
    s = Sampling(max_new_tokens=10)
    alone = eng.generate([_requests()[2]], s)[0]
    batched = eng.generate(_requests(), s)[2]
    assert [c.token_ids for c in alone] == [c.token_ids for c in batched]
    again = eng.generate(_requests(), s)
    other = eng.generate([Request(r.context, r.n, r.seed + 1) for r in _requests()], s)
    flat = lambda o: [c.token_ids for cs in o for c in cs]  # noqa: E731
    assert flat(again) == flat(eng.generate(_requests(), s))
    assert flat(other) != flat(again)
    greedy = eng.generate(_requests(n=2), Sampling(temperature=0.0, max_new_tokens=10))
    assert all(cs[0].token_ids == cs[1].token_ids for cs in greedy)
    # a tiny nucleus keeps only the top token: sampling becomes greedy
    nucleus = eng.generate(_requests(n=2), Sampling(temperature=1.0, top_p=1e-6, max_new_tokens=10))
    assert flat(nucleus) == flat(greedy)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_logprobs_match_forward_pass(policy_dir, lake):
    from pipeline.rollout.hf import load_model
    from pipeline.rollout.vllm_engine import VLLMEngine

    eng = VLLMEngine(policy_dir)
    try:
        model = load_model(policy_dir)
        cont = vocab.encode("<bos>37*45=<call>37*45</call><obs>1665</obs>")
        reqs = _requests() + [Request(tuple(cont), n=2, seed=7)]
        out, checked = _check_agreement(eng, model, reqs, Sampling(temperature=1.0, max_new_tokens=12))
        assert checked > 20
        again = eng.generate(reqs, Sampling(temperature=1.0, max_new_tokens=12))
        assert [[c.token_ids for c in cs] for cs in out] == [[c.token_ids for c in cs] for cs in again]
        # the harness on vLLM: multi-turn trajectories that pass the lake's validation
        from pipeline.rollout.envs import get_env
        from pipeline.rollout.harness import Harness
        from pipeline.rollout.spool import Spool, ship

        env = get_env("arithmetic-tool")
        spool = Spool(lake.uri + "/_spool", "w-vllm", fsync=False)
        h = Harness(env, lambda: (eng, 0), spool, run_id="vllm", worker_id="w-vllm",
                    sampling=Sampling(max_new_tokens=16))
        h.run([h.new_episode(episode_id=f"v-{i}", group_id=f"v-{i // 4}", group_size=4, task=env.reset(i // 4),
                             seed=i, policy_version=0) for i in range(16)])
        rep = ship(lake, spool)
        assert rep.trajectories == 16 and rep.quarantined == 0
        rows = lake.read("trajectories", columns=["prompt_ids", "response_ids", "response_logprobs",
                                                  "loss_mask"]).to_pylist()
        for r in rows:   # behaviour log-probs of every policy token (across turns) match the forward pass
            full = teacher_forced_logprobs_masked(model, r)
            assert max(abs(a - b) for a, b in full) < 1e-4
        assert h.stats.steps > 2       # continuous batching: one engine step per token, requests joining
        # in-place weight switch: the running engine now samples from the other policy (no new engine)
        other = _perturbed(policy_dir, lake.uri + "/other")
        llm = eng.llm
        assert eng.load_weights(other) and eng.llm is llm
        switched, _ = _check_agreement(eng, load_model(other), reqs, Sampling(temperature=1.0, max_new_tokens=12))
        from pipeline.rollout.hf import teacher_forced_logprobs

        c = switched[0][0]                     # and no longer the old policy's
        ref_old = teacher_forced_logprobs(model, list(reqs[0].context), c.token_ids)
        assert max(abs(a - b) for a, b in zip(ref_old, c.logprobs)) > 1e-3
        _vllm_switches_by_delta_and_falls_back(eng, policy_dir, other, lake, reqs, model)
    finally:
        eng.close()


def _vllm_switches_by_delta_and_falls_back(eng, policy_dir, other, lake, reqs, model):
    """A published version's sparse delta applied in place (the changed modules pushed, the same
    engine): it serves the new weights; a reader off the chain (no deltas) loads the full weights."""
    from pipeline.policy_store import delta as wd
    from pipeline.rollout.backends import switch_weights
    from pipeline.rollout.hf import load_model

    llm = eng.llm
    w_other = wd.load_hf_weights(other)
    sparse = _perturbed(other, lake.uri + "/sparse", frac=0.03, names=("model.layers.0.self_attn.k_proj.weight",
                                                                          "lm_head.weight"))
    w_sparse = wd.load_hf_weights(sparse)
    delta = wd.make_delta(w_other, w_sparse)
    assert sorted(k.rsplit("::", 1)[0] for k in delta[0] if k.endswith("::dif")) == [
        "lm_head.weight", "model.layers.0.self_attn.k_proj.weight"]
    eng2, rec = switch_weights(eng, sparse, deltas=[delta])
    assert rec["mode"] == "delta" and eng2 is eng and eng.llm is llm and eng.hf_dir == sparse
    # the CPU build repacks the weights it serves (the parameters read back empty): the served policy is checked by
    # its log-probs, those of the new weights (the fused q/k/v layer rebuilt from all three, the untouched layers
    # kept) and no longer those of the old ones
    out, _ = _check_agreement(eng, load_model(sparse), reqs, Sampling(temperature=1.0, max_new_tokens=12))
    from pipeline.rollout.hf import teacher_forced_logprobs

    old = load_model(other)
    assert max(abs(a - b) for r, cs in zip(reqs, out) for c in cs
               for a, b in zip(teacher_forced_logprobs(old, list(r.context), c.token_ids), c.logprobs)) > 1e-3
    eng2, rec = switch_weights(eng, policy_dir, deltas=None)        # off the chain: the full weights
    assert rec["mode"] == "in_place" and eng2 is eng and eng.llm is llm
    _check_agreement(eng, model, reqs, Sampling(temperature=1.0, max_new_tokens=12))


def _perturbed(src, dst, frac: float = 1.0, names: tuple[str, ...] | None = None):
    """A copy of the policy with other weights (same architecture): ``frac`` of the
    elements of ``names`` (default: every tensor) moved."""
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    dst = Path(dst)
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    def move(v):
        step = 0.05 * torch.randn(v.shape, generator=g)
        return v + (step if frac >= 1 else step * (torch.rand(v.shape, generator=g) < frac))

    save_file({k: move(v) if names is None or k in names else v for k, v in state.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_hf_switches_weights_in_place(policy_dir, tmp_path):
    from pipeline.rollout.hf import HFEngine, load_model

    eng = HFEngine(policy_dir, threads=1)
    model = eng.model
    other = _perturbed(policy_dir, tmp_path / "other")
    assert eng.load_weights(other) and eng.model is model and eng.hf_dir == other
    _check_agreement(eng, load_model(other), _requests(), Sampling(temperature=1.0, max_new_tokens=12))
    fresh = HFEngine(other, threads=1)
    s = Sampling(max_new_tokens=12)
    assert [[c.logprobs for c in cs] for cs in eng.generate(_requests(), s)] == \
        [[c.logprobs for c in cs] for cs in fresh.generate(_requests(), s)]
    # another architecture cannot be loaded in place: refused, nothing changed
    import json

    wide = tmp_path / "wide"
    import shutil

    shutil.copytree(policy_dir, wide)
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": cfg["num_hidden_layers"] + 1}))
    assert not eng.load_weights(wide) and eng.hf_dir == other


def teacher_forced_logprobs_masked(model, row):
    """(engine log-prob, forward-pass log-prob) for every policy token of a multi-turn row."""
    from pipeline.rollout.hf import teacher_forced_logprobs

    ref = teacher_forced_logprobs(model, row["prompt_ids"], row["response_ids"])
    return [(a, b) for a, b, m in zip(row["response_logprobs"], ref, row["loss_mask"]) if m == 1]
