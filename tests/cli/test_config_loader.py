"""The config loader reads values as YAML users write them and checks ranges
before any work starts (issue 15)."""

from __future__ import annotations

import pytest

from pipeline.config import describe, load_config, parse_set
from pipeline.errors import ConfigError


def test_scientific_notation_in_set_and_yaml(tmp_path):
    from pipeline.admission.config import AdmissionConfig
    from pipeline.train.config import TrainConfig

    assert load_config(TrainConfig, None, parse_set(["lr=1e-4"])).lr == 1e-4
    assert load_config(TrainConfig, None, parse_set(["lr=5E-5"])).lr == 5e-5
    assert load_config(AdmissionConfig, None, parse_set(["min_reward_std=1e-3"])).min_reward_std == 1e-3
    f = tmp_path / "train.yaml"
    f.write_text("lr: 1e-4\nmax_grad_norm: 1\nclip_high: .28\n")
    cfg = load_config(TrainConfig, f)
    assert (cfg.lr, cfg.max_grad_norm, cfg.clip_high) == (1e-4, 1.0, 0.28)
    assert isinstance(cfg.max_grad_norm, float)


def test_integer_for_a_string_key_as_documented():
    from pipeline.train.config import TrainConfig

    # the help text says kl_reference may be a policy version
    assert load_config(TrainConfig, None, parse_set(["kl_reference=2"])).kl_reference == "2"


def test_ranges_refused_up_front():
    from pipeline.rollout.run import RolloutConfig

    with pytest.raises(ConfigError, match=r"top_p=1.5 is out of range: must be > 0, <= 1"):
        load_config(RolloutConfig, None, parse_set(["top_p=1.5"]))
    with pytest.raises(ConfigError, match="temperature"):
        load_config(RolloutConfig, None, parse_set(["temperature=-1"]))
    with pytest.raises(ConfigError, match="NaN"):
        load_config(RolloutConfig, None, parse_set(["temperature=.nan"]))


def test_malformed_yaml_is_a_config_error(tmp_path):
    from pipeline.train.config import TrainConfig

    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(TrainConfig, bad)
    with pytest.raises(ConfigError, match="not a YAML value"):
        parse_set(["update_if=[a"])


def test_describe_lists_bounds():
    from pipeline.rollout.run import RolloutConfig

    helps = {name: h for name, _, h in describe(RolloutConfig)}
    assert helps["top_p"].endswith("(> 0, <= 1)")


def test_top_p_refused_by_the_cli_before_any_rollout(tmp_path, capsys):
    from pipeline.cli import main

    lake = tmp_path / "lake"
    code = main(["rollout", "--lake", str(lake), "--set", "top_p=1.5"])
    err = capsys.readouterr().err
    assert code == 2 and "top_p=1.5 is out of range" in err
    assert not lake.exists(), "a refused config must not create the lake"
