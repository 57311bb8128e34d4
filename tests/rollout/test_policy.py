"""Tokenizer and policy directory: the saved HF tokenizer equals the harness's vocab."""

from __future__ import annotations

import json

from pipeline import vocab


def test_vocab_roundtrip():
    text = "<bos>37*45=<call>37*45</call><obs>1665</obs><ans>1665<eos>"
    ids = vocab.encode(text)
    assert vocab.decode(ids) == text
    assert ids[:2] == [vocab.BOS_ID, vocab.ID["3"]]
    assert len(ids) == 1 + 6 + 1 + 5 + 1 + 1 + 4 + 1 + 1 + 4 + 1


def test_saved_tokenizer_matches_vocab(policy_dir):
    from pipeline.rollout.policy import load_policy

    model, tok = load_policy(policy_dir)
    for text in ["37*45=", "<call>12+9</call><obs>21</obs><ans>21<eos>", "r:40213=<ans>31204<eos>"]:
        assert tok(text, add_special_tokens=False)["input_ids"] == vocab.encode(text)
        assert tok.decode(vocab.encode(text)) == text
    assert tok.eos_token_id == vocab.EOS_ID and tok.pad_token_id == vocab.PAD_ID
    cfg = json.loads((policy_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == vocab.VOCAB_SIZE
    assert (policy_dir / "model.safetensors").exists()
    assert model.config.hidden_size // model.config.num_attention_heads == 32


def test_init_policy_publishes_version_0_once(lake):
    from pipeline.errors import ConflictError
    from pipeline.policy_store import latest_policy_version, resolve_policy
    from pipeline.rollout.policy import init_policy

    ref = init_policy(lake, warm_start_steps=2, demonstrations=50)
    assert ref.policy_version == 0 and latest_policy_version(lake) == 0
    assert resolve_policy(lake, 0).checkpoint_id == ref.checkpoint_id       # hash-verified
    again = init_policy(lake, warm_start_steps=2, demonstrations=50)          # same config: a no-op
    assert again.checkpoint_id == ref.checkpoint_id
    assert lake.read("checkpoints", columns=["checkpoint_id"]).num_rows == 1
    try:
        init_policy(lake, warm_start_steps=3, demonstrations=50)
    except ConflictError:
        pass
    else:
        raise AssertionError("a second, different version 0 must be refused")
