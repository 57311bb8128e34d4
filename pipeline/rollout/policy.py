"""Policy version 0: ``pipeline policy init``.

Builds the char tokenizer and a tiny Llama from a config, runs a short
supervised warm start on synthetic demonstrations of the built-in tasks, saves
the Hugging Face directory under ``<lake>/_checkpoints/<id>.<run tag>/hf/`` and publishes
it as policy version 0 (pipeline.policy_store).

Why a warm start with *mixed* demonstrations: GRPO learns only from groups
whose rewards differ. On ``arithmetic-tool`` the demonstrations call the
calculator in ``tool_fraction`` of the cases and answer directly otherwise;
the tiny model learns to copy the expression into the tool and the result into
the answer, but cannot multiply two-digit numbers itself, so version 0 succeeds
about as often as it chooses the tool (measured: ~30% of samples at T=1,
~1% greedy). RL then has one clear thing to discover: call the tool.

    pipeline policy init --lake ./lake                   # ~20 s on one CPU core
    pipeline policy init --set warm_start_steps=100      # faster, weaker
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pipeline.config import config_dict, config_hash
from pipeline.errors import ConflictError
from pipeline.policy_store import HF_SUBDIR, PolicyRef, local_dir, publish_checkpoint, resolve_policy, run_checkpoint_rel
from pipeline import vocab

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake


@dataclass(frozen=True)
class PolicyInitConfig:
    config_section: ClassVar[str] = "policy"   # its section in an experiment file (pipeline.config.SECTIONS)

    seed: int = field(default=0, metadata={"ge": 0, "help": "model init, demonstration sampling and training seed"})
    hidden_size: int = field(default=64, metadata={"ge": 1, "help": "model width"})
    num_layers: int = field(default=2, metadata={"ge": 1, "help": "transformer blocks"})
    num_heads: int = field(default=2, metadata={"ge": 1, "help": "attention heads (head size 32: vLLM CPU's smallest)"})
    intermediate_size: int = field(default=256, metadata={"ge": 1, "help": "MLP width"})
    max_positions: int = field(default=128, metadata={"ge": 8, "help": "longest context (prompt + response)"})
    envs: tuple[str, ...] = field(default=("arithmetic-tool", "reverse-digits"),
                                  metadata={"help": "environments whose demonstrations the warm start uses"})
    env_weights: tuple[float, ...] = field(default=(0.8, 0.2), metadata={"ge": 0, "help": "share of demonstrations per env"})
    demonstrations: int = field(default=4000, metadata={"ge": 1, "help": "synthetic demonstrations"})
    tool_fraction: float = field(default=0.4, metadata={"ge": 0, "le": 1,
        "help": "share of arithmetic demonstrations that use the calculator (the rest answer directly)"})
    warm_start_steps: int = field(default=300, metadata={"ge": 0, "help": "supervised steps (0 = random weights)"})
    batch_size: int = field(default=64, metadata={"ge": 1, "help": "demonstrations per step"})
    lr: float = field(default=3e-3, metadata={"gt": 0, "help": "peak learning rate (AdamW, warmup + linear decay)"})
    threads: int = field(default=1, metadata={"ge": 1, "help": "torch threads (1 is fastest for tiny models on shared CPUs)"})


def build_tokenizer():
    """The char tokenizer as a transformers ``PreTrainedTokenizerFast``."""
    from pipeline.rollout.hf import build_tokenizer as _build

    return _build()


def load_policy(hf_dir: str | Path, device: str = "cpu"):
    """(model, tokenizer) from a policy directory (HF format)."""
    from pipeline.rollout import hf

    return hf.load_model(hf_dir, device), hf.load_tokenizer(hf_dir)


def demonstrations(cfg: PolicyInitConfig) -> tuple[list[list[int]], list[list[int]]]:
    """(token sequences, masks): mask 1 on the demonstration's policy tokens.
    Demonstration prompts come from the train split only."""
    from pipeline.rollout.engine import derive_seed
    from pipeline.errors import ConfigError
    from pipeline.rollout.envs import Demonstrating, get_env

    rng = random.Random(cfg.seed)
    envs = [get_env(n) for n in cfg.envs]
    seqs, masks = [], []
    for i in range(cfg.demonstrations):
        env = rng.choices(envs, weights=list(cfg.env_weights)[:len(envs)])[0]
        if not isinstance(env, Demonstrating):
            raise ConfigError(f"environment {env.name!r} has no demonstration(task, rng, tool_fraction)",
                              hint="the policy init's warm start trains on demonstrations: list environments "
                                   "that write them in envs")
        task = env.reset(derive_seed("demo", cfg.seed, i), "train")
        segs = env.demonstration(task, rng, tool_fraction=cfg.tool_fraction)
        ids = [vocab.BOS_ID] + vocab.encode(task.prompt)
        m = [0] * len(ids)
        for text, is_policy in segs:
            e = vocab.encode(text)
            ids += e
            m += [int(is_policy)] * len(e)
        seqs.append(ids)
        masks.append(m)
    return seqs, masks


def init_policy(lake: Lake, cfg: PolicyInitConfig | None = None, *, progress=None, **overrides: Any) -> PolicyRef:
    """Build, warm-start, save and publish policy version 0. Idempotent for the
    same config (returns the already published version). ``progress(n)`` is
    called after every warm-start step (the CLI's progress bar)."""
    from pipeline.rollout import hf
    from pipeline.policy_store import latest_policy_version

    if cfg is None:
        from pipeline.config import load_config

        cfg = load_config(PolicyInitConfig, None, overrides)
    elif overrides:
        import dataclasses

        cfg = dataclasses.replace(cfg, **overrides)
    chash = config_hash(cfg)
    ckpt_id = f"v0-{chash[:12]}"
    latest = latest_policy_version(lake)
    if latest is not None:
        ref = resolve_policy(lake, 0)
        if ref.checkpoint_id == ckpt_id:
            return ref
        raise ConflictError(f"lake {lake.uri} already has policy version 0 ({ref.checkpoint_id}), "
                            f"made with a different config", hint="use a new --lake, or keep the existing policy")
    hf.set_threads(cfg.threads)
    model = hf.build_model(hf.Arch(cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
                                   cfg.max_positions), seed=cfg.seed)
    stats: dict[str, Any] = {"steps": 0}
    if cfg.warm_start_steps:
        seqs, masks = demonstrations(cfg)
        stats = hf.warm_start(model, seqs, masks, steps=cfg.warm_start_steps, batch_size=cfg.batch_size,
                              lr=cfg.lr, seed=cfg.seed, progress=progress)
    rel = run_checkpoint_rel(ckpt_id)     # this init's own directory: a racing init writes another one
    root = local_dir(lake, rel)
    hf.save_policy(model, root / HF_SUBDIR)
    from pipeline.rollout.envs import get_env

    train_cfg = config_dict(cfg) | {"kind": "warm_start", "tokenizer_rev": vocab.TOKENIZER_REV,
                                    "prompt_template_revs": sorted({get_env(n).prompt_template_rev for n in cfg.envs})}
    publish_checkpoint(lake, checkpoint_id=ckpt_id, policy_version=0, parent_checkpoint_id=None, snapshot_ids=[],
                       train_config=train_cfg, train_config_hash=chash, seed=cfg.seed, world_size=1,
                       global_step=int(stats.get("steps", 0)), samples_seen=int(stats.get("steps", 0)) * cfg.batch_size,
                       metrics={"warm_start_loss": stats.get("loss"), "warm_start_seconds": stats.get("seconds")},
                       command="pipeline policy init", rel=rel)
    return resolve_policy(lake, 0)
