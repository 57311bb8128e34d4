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


# -- one experiment file for every command (issue 32) ---------------------------------------------------------

EXPERIMENT = """\
train:
  lr: 1e-4
  seed: 3
  epochs: 2
admission:
  max_policy_lag: 2
  min_valid_members: 3
rollout:
  groups: 5
  seed: ${train.seed}
"""


def _experiment(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text(EXPERIMENT)
    return f


def test_each_command_reads_its_section_of_one_experiment_file(tmp_path):
    from pipeline.admission.config import AdmissionConfig
    from pipeline.rollout.run import RolloutConfig
    from pipeline.train.config import TrainConfig

    f = _experiment(tmp_path)
    t = load_config(TrainConfig, f)
    assert (t.lr, t.seed, t.epochs) == (1e-4, 3, 2)
    a = load_config(AdmissionConfig, f)
    assert (a.max_policy_lag, a.min_valid_members) == (2, 3)
    r = load_config(RolloutConfig, f)
    assert r.groups == 5 and r.seed == 3, "interpolation ${train.seed} resolves across sections"
    # defaults fill what the section leaves out, exactly as a flat file does
    assert t.max_grad_norm == TrainConfig().max_grad_norm


def test_dotted_and_flat_overrides(tmp_path):
    from pipeline.train.config import TrainConfig

    f = _experiment(tmp_path)
    assert load_config(TrainConfig, f, parse_set(["train.lr=5e-5"])).lr == 5e-5
    assert load_config(TrainConfig, f, parse_set(["lr=7e-5"])).lr == 7e-5
    assert load_config(TrainConfig, None, parse_set(["train.epochs=4"])).epochs == 4
    # a file value read by an interpolation follows the file, and a flat override of the interpolated key wins
    from pipeline.rollout.run import RolloutConfig

    assert load_config(RolloutConfig, f, parse_set(["seed=11"])).seed == 11


def test_override_for_another_section_is_refused_not_ignored(tmp_path):
    from pipeline.train.config import TrainConfig

    with pytest.raises(ConfigError, match=r"'admission.max_policy_lag' is for the `admission` section; "
                                          r"this command reads `train`"):
        load_config(TrainConfig, None, parse_set(["admission.max_policy_lag=2"]))


def test_did_you_mean_on_a_typo():
    from pipeline.train.config import TrainConfig

    with pytest.raises(ConfigError) as exc:
        load_config(TrainConfig, None, parse_set(["lrr=1e-4"]))
    assert "unknown config key(s) ['lrr']" in exc.value.message
    assert "did you mean `lr`?" in (exc.value.hint or "")
    assert "max_grad_norm" not in (exc.value.hint or ""), "a close match replaces the list of every key"


def test_stray_top_level_key_in_a_sectioned_file(tmp_path):
    from pipeline.train.config import TrainConfig

    f = tmp_path / "exp.yaml"
    f.write_text("trian:\n  lr: 1e-4\nadmission:\n  max_policy_lag: 2\n")
    with pytest.raises(ConfigError, match=r"mixes sections \(admission\) with top-level key\(s\) \['trian'\]") as exc:
        load_config(TrainConfig, f)
    assert "did you mean `train`?" in (exc.value.hint or "")


def test_bad_interpolation_is_a_config_error(tmp_path):
    from pipeline.rollout.run import RolloutConfig

    f = tmp_path / "exp.yaml"
    f.write_text("rollout:\n  seed: ${train.nope}\n")
    with pytest.raises(ConfigError, match="config for `rollout`"):
        load_config(RolloutConfig, f)


def test_print_config_prints_the_resolved_section_and_runs_nothing(tmp_path, capsys):
    import json

    import yaml

    from pipeline.cli import main

    f = _experiment(tmp_path)
    lake = tmp_path / "lake"
    code = main(["admit", "--lake", str(lake), "--config", str(f), "--set", "admission.max_policy_lag=4",
                 "--print-config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert code == 0
    assert printed["admission"]["max_policy_lag"] == 4 and printed["admission"]["min_valid_members"] == 3
    assert not lake.exists(), "--print-config runs nothing"
    code = main(["rollout", "--lake", str(lake), "--config", str(f), "--print-config", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["rollout"]["seed"] == 3 and doc["rollout"]["groups"] == 5
    assert not lake.exists()
