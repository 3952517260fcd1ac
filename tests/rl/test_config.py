"""Config dataclasses, presets and key=value overrides (pure Python, fast).

Run: python -m pytest tests/rl/test_config.py -q
"""

import pathlib
import re
import sys
import typing
import warnings

import pytest
import yaml
from repo_scripts import load_script

from rl_extension.config import (
    ActorConfig,
    ModelConfig,
    PPOConfig,
    RolloutConfig,
    SFTConfig,
    TinyModelConfig,
    TrainerConfig,
    apply_overrides,
    config_keys,
    field_docs,
    load_config,
    preset_names,
    save_config,
    to_dict,
)
from rl_extension.config.ranges import Range, describe_ranges

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference():
    """scripts/config_reference.py, the generator of docs/rl/config.md's tables."""
    yield load_script("scripts/config_reference.py", "config_reference")
    del sys.modules["config_reference"]


def test_every_field_of_every_section_has_a_docstring():
    for root in (PPOConfig, SFTConfig):
        for key in config_keys(root):
            section = root()
            *path, name = key.split(".")
            for part in path:
                section = getattr(section, part)
            assert field_docs(type(section)).get(name), f"{key} has no docstring"


def test_overrides_are_parsed_to_the_field_type():
    config = apply_overrides(
        PPOConfig(),
        [
            "actor.lr=3e-5",
            "rollout.n=4",
            "actor.use_kl_loss=true",
            "trainer.loggers=jsonl,console",
            "data.train_files=[a.parquet, b.parquet]",
            "reward.scorer_kwargs={format_score: 0.1}",
            "algorithm.kl_ctrl.kind=adaptive",
            "actor.betas=[0.9, 0.95]",
            "model.tiny.num_layers=2",
        ],
    )
    assert config.actor.lr == 3e-5 and isinstance(config.actor.lr, float)
    assert config.rollout.n == 4 and isinstance(config.rollout.n, int)
    assert config.actor.use_kl_loss is True
    assert config.trainer.loggers == ["jsonl", "console"]
    assert config.data.train_files == ["a.parquet", "b.parquet"]
    assert config.reward.scorer_kwargs == {"format_score": 0.1}
    assert config.algorithm.kl_ctrl.kind == "adaptive"
    assert config.actor.betas == [0.9, 0.95]
    assert config.model.tiny.num_layers == 2
    assert PPOConfig().rollout.n != 4  # the original is untouched


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.lrr=1", "did you mean 'actor.lr'"),
        ("temperature=0.5", "did you mean 'rollout.temperature'"),
        ("nosuch.key=1", "unknown config key 'nosuch.key'"),
        ("rollout.n=four", "rollout.n expects an integer"),
        ("actor.use_kl_loss=maybe", "expects true or false"),
        ("actor.lr", "must look like section.key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        apply_overrides(PPOConfig(), [override])


def test_presets_only_override_defaults_and_load(tmp_path):
    assert {"tiny-cpu", "tiny-cpu-ppo", "sft-tiny-cpu"} <= set(preset_names())
    grpo = load_config(PPOConfig, "tiny-cpu")
    ppo = load_config(PPOConfig, "tiny-cpu-ppo")
    assert grpo.algorithm.adv_estimator == "grpo" and not grpo.use_critic
    assert ppo.algorithm.adv_estimator == "gae" and ppo.use_critic
    assert ppo.data.max_prompt_length == grpo.data.max_prompt_length  # inherited through `base:`
    assert (
        (ppo.data.train_batch_size, ppo.rollout.n) == (16, 8) != (grpo.data.train_batch_size, grpo.rollout.n)
    )
    sft = load_config(SFTConfig, "sft-tiny-cpu", ["total_steps=10"])
    assert sft.total_steps == 10


def test_unknown_key_in_a_preset_file_is_an_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor:\n  learning_rate: 1.0e-5\n")
    with pytest.raises(ValueError, match="unknown config key 'actor.learning_rate'.*from preset"):
        load_config(PPOConfig, str(path))


def test_saved_config_round_trips(tmp_path):
    config = load_config(PPOConfig, "tiny-cpu", ["actor.lr=4e-5", "trainer.total_steps=7"])
    path = save_config(config, tmp_path / "config.yaml")
    assert yaml.safe_load(open(path))["actor"]["lr"] == 4e-5
    assert load_config(PPOConfig, path) == config
    assert to_dict(config)["trainer"]["total_steps"] == 7


def test_validation_rejects_inconsistent_values_and_warns_about_ignored_ones():
    with pytest.raises(ValueError, match="model.path is empty"):
        load_config(PPOConfig)
    with pytest.raises(ValueError, match="multiple of actor.ppo_mini_batch_size"):
        load_config(PPOConfig, "tiny-cpu", ["actor.ppo_mini_batch_size=5"])
    with pytest.raises(ValueError, match="inline backend"):
        load_config(PPOConfig, "tiny-cpu", ["trainer.backend=inline"])
    with pytest.raises(ValueError, match="drop_uniform_groups needs group advantages.*adv_estimator=gae"):
        load_config(PPOConfig, "tiny-cpu-ppo", ["algorithm.drop_uniform_groups=true"])
    with pytest.raises(ValueError, match="drop_uniform_groups.*rollout.n=1"):
        load_config(PPOConfig, "tiny-cpu", ["algorithm.drop_uniform_groups=true", "rollout.n=1"])
    with pytest.raises(ValueError, match="dynamic_sampling needs group advantages.*adv_estimator=gae"):
        load_config(PPOConfig, "tiny-cpu-ppo", ["algorithm.dynamic_sampling=true"])
    with pytest.raises(ValueError, match="guide_failed_groups needs group advantages.*adv_estimator=gae"):
        load_config(PPOConfig, "tiny-cpu-ppo", ["algorithm.guide_failed_groups=true"])
    with pytest.raises(
        ValueError,
        match="guide_failed_groups with rollout.multi_turn.enable=true needs data.demonstration_key",
    ):
        load_config(PPOConfig, "calc-cpu", ["model.path=tiny", "algorithm.guide_failed_groups=true"])
    with pytest.warns(UserWarning, match="max_sample_rounds is ignored without algorithm.dynamic_sampling"):
        load_config(
            PPOConfig, "tiny-cpu", ["algorithm.dynamic_sampling=false", "algorithm.max_sample_rounds=2"]
        )
    with pytest.warns(UserWarning, match="critic.lr ignored"):
        load_config(PPOConfig, "tiny-cpu", ["critic.lr=1e-3"])
    with pytest.warns(UserWarning, match="max_restarts is ignored on the inline backend"):
        load_config(
            PPOConfig,
            "tiny-cpu",
            ["trainer.backend=inline", "trainer.num_workers=1", "trainer.max_restarts=2"],
        )
    with pytest.raises(ValueError, match="max_restarts"):
        load_config(PPOConfig, "tiny-cpu", ["trainer.max_restarts=-1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(PPOConfig, "tiny-cpu-ppo", ["critic.lr=1e-3"])  # used: no warning


# Numeric keys with no natural bound: a weight may be negative (a penalty), an entropy coefficient too.
UNBOUNDED = {"actor.entropy_coeff", "reward.rule_weight", "reward.model_weight"}


def test_every_numeric_key_declares_its_range():
    for root in (PPOConfig, SFTConfig):
        for key in config_keys(root):
            *path, name = key.split(".")
            section = root()
            for part in path:
                section = getattr(section, part)
            tp = typing.get_type_hints(type(section))[name]
            numeric = tp in (int, float) or (
                typing.get_origin(tp) is list and typing.get_args(tp)[0] in (int, float)
            )
            if numeric and key not in UNBOUNDED:
                assert name in describe_ranges(type(section)), f"{key} ({tp}) declares no Range"


@pytest.mark.parametrize(
    "cls, preset, override, message",
    [
        (PPOConfig, "tiny-cpu", "actor.lr=-1e-4", "actor.lr must be >= 0, got -0.0001"),
        (PPOConfig, "tiny-cpu-ppo", "critic.lr=-1", "critic.lr must be >= 0, got -1.0"),
        (SFTConfig, "sft-tiny-cpu", "lr=-1", "lr must be >= 0, got -1.0"),
        (PPOConfig, "tiny-cpu", "rollout.n=0", "rollout.n must be >= 1, got 0"),
        (PPOConfig, "tiny-cpu", "rollout.top_p=1.5", "rollout.top_p must be > 0 and <= 1, got 1.5"),
        (PPOConfig, "tiny-cpu", "rollout.temperature=0", "rollout.temperature must be > 0"),
        (PPOConfig, "tiny-cpu", "rollout.temperature=nan", "rollout.temperature must be > 0, got nan"),
        (PPOConfig, "tiny-cpu", "actor.fsdp_size=0", "actor.fsdp_size must be >= 1 or -1, got 0"),
        (PPOConfig, "tiny-cpu", "actor.betas=[0.9, 1.0]", r"actor.betas\[1\] must be >= 0 and < 1"),
        (PPOConfig, "tiny-cpu", "actor.betas=[0.9]", "actor.betas must hold two numbers"),
        (SFTConfig, "sft-tiny-cpu", "betas=[0.9]", "betas must hold two numbers"),
        (SFTConfig, "sft-tiny-cpu", "betas=[0.9, 1.0]", r"betas\[1\] must be >= 0 and < 1"),
        (PPOConfig, "tiny-cpu", "algorithm.gamma=1.5", "algorithm.gamma must be >= 0 and <= 1"),
        (PPOConfig, "tiny-cpu", "algorithm.kl_ctrl.horizon=0", "algorithm.kl_ctrl.horizon must be > 0"),
        (PPOConfig, "tiny-cpu", "trainer.call_timeout_s=0", "trainer.call_timeout_s must be > 0"),
        (PPOConfig, "tiny-cpu", "data.synthetic.num_train=0", "data.synthetic.num_train must be >= 1"),
        (
            PPOConfig,
            "tiny-cpu",
            "model.tiny.num_heads=8",
            "model.tiny.hidden_size / model.tiny.num_heads = 16",
        ),
        (PPOConfig, "tiny-cpu", "model.tiny.num_heads=3", "model.tiny.hidden_size=128 must be a multiple"),
        (SFTConfig, "sft-tiny-cpu", "stop_at_accuracy=2", "stop_at_accuracy must be >= 0 and <= 1, got 2.0"),
    ],
)
def test_out_of_range_values_name_the_key(cls, preset, override, message):
    with pytest.raises(ValueError, match=message):
        load_config(cls, preset, [override])


def test_each_section_checks_itself():
    with pytest.raises(ValueError, match="actor.betas must hold two numbers"):
        ActorConfig(betas=[0.9]).check("actor.")
    with pytest.raises(ValueError, match="rollout.top_p must be > 0 and <= 1, got 2.0"):
        RolloutConfig(top_p=2.0).check("rollout.")
    with pytest.raises(ValueError, match=r"trainer.loggers: unknown \['x'\]"):
        TrainerConfig(loggers=["x"]).check("trainer.")
    with pytest.raises(ValueError, match="use trainer.num_workers=1"):
        TrainerConfig(backend="inline").check("trainer.")
    with pytest.raises(ValueError, match="inline backend .* cannot: use trainer.backend=process"):
        TrainerConfig(backend="inline", num_workers=1, mode="async").check("trainer.")
    # a section's sections check themselves, ranges first (no division by zero heads)
    with pytest.raises(ValueError, match="model.tiny.num_heads must be >= 1, got 0"):
        ModelConfig(path="tiny", tiny=TinyModelConfig(num_heads=0)).check("model.")
    ModelConfig(path="some/model").check("model.")


def test_range_bounds_and_text():
    fsdp = Range(ge=1, also=(-1,))
    assert 1 in fsdp and -1 in fsdp and 0 not in fsdp and float("nan") not in Range(gt=0)
    assert str(Range(gt=0, le=1)) == "> 0 and <= 1" and str(fsdp) == ">= 1 or -1"
    assert describe_ranges(ActorConfig)["betas"] == "each >= 0 and < 1"
    load_config(PPOConfig, "tiny-cpu", ["actor.lr=0", "model.path=some/model", "model.tiny.num_heads=8"])


def test_field_docs_and_reference_table(reference):
    assert field_docs(RolloutConfig)["temperature"].startswith("Sampling temperature")
    assert "ppo_epochs" in field_docs(ActorConfig)
    table = reference.markdown_reference()
    for key in config_keys(PPOConfig) + config_keys(SFTConfig):
        assert f"`{key}`" in table


def test_docs_config_reference_is_generated_from_the_dataclasses(reference, tmp_path):
    page = ROOT / "docs" / "rl" / "config.md"
    assert reference.markdown_reference() in page.read_text(), (
        "regenerate docs/rl/config.md: python scripts/config_reference.py --write docs/rl/config.md"
    )
    copy = tmp_path / "config.md"
    copy.write_text(page.read_text())
    assert reference.main(["--write", str(copy)]) == 0
    assert copy.read_text() == page.read_text()  # the marker is there, and nothing after the tables


def test_cli_prints_configs_and_rejects_unknown_keys(capsys):
    from rl_extension.app.cli import main

    assert main(["presets"]) == 0
    assert "tiny-cpu-ppo" in capsys.readouterr().out
    assert main(["config", "preset=tiny-cpu", "rollout.n=3"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["rollout"]["n"] == 3
    assert main(["config", "--keys"]) == 0
    assert "rollout.temperature" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="did you mean 'actor.lr'"):
        main(["train", "preset=tiny-cpu", "actor.lrr=1"])
    with pytest.raises(SystemExit, match="expected key=value"):
        main(["train", "tiny-cpu"])


def test_cli_presets_lists_each_preset_with_a_whole_sentence_in_aligned_columns(capsys, monkeypatch):
    from rl_extension.app.cli import main
    from rl_extension.config import PRESET_DIR

    monkeypatch.setenv("COLUMNS", "100")
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 100 for line in lines), lines
    entries: dict[str, list[str]] = {}  # name -> its description, line by line
    for line in lines:
        if line[:1].strip():
            name, _, rest = line.partition(" ")
            entries[name] = [rest]
        else:
            entries[name].append(line)
    assert sorted(entries) == preset_names()
    # Every description starts in one column, to the right of the longest name.
    starts = {re.match(r"\S*\s+", line).end() for line in lines}
    assert len(starts) == 1 and starts.pop() > max(map(len, entries)), lines
    for name, parts in entries.items():
        summary = " ".join(part.strip() for part in parts)
        header = " ".join(
            line.lstrip("#").strip()
            for line in (PRESET_DIR / f"{name}.yaml").read_text().splitlines()
            if line.startswith("#")
        )
        # The first sentence of the preset's header comment, whole: it ends where a sentence ends.
        assert summary.endswith(".") and header.startswith(summary), (name, summary)
        assert header[len(summary) : len(summary) + 1] in ("", " "), (name, summary)
