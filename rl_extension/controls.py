"""The controls of a demo run: what the same warm start learns without the reward, or from SFT alone.

A learning figure says what the reward taught only beside its controls (docs/rl/results.md):

- ``no_reward``: the same recipe with the reward removed (every sample scores about 0, so every
  advantage is about 0). A recipe that learns from the reward alone learns nothing here; one with a
  supervised term (``actor.sft_loss_coef``) or guidance learns what those teach, and the difference
  to the recipe is the reward's own contribution.
- ``sft_more``: SFT continued from the same warm start for the recipe's GRPO minutes, on the same
  demonstrations. Only for a recipe that reads demonstrations: it asks whether the RL run beat
  spending its minutes on more supervised training.

Used by ``benchmarks/rl/demo_seeds.py --controls`` and ``benchmarks/rl/ablation.py --controls``.
"""

from __future__ import annotations

import time
from pathlib import Path

from rl_extension.demo import run_demo

__all__ = ["NO_REWARD", "reads_demonstrations", "run_controls"]

# The reward removed: a vanishing rule weight (the config refuses 0 with no reward model) and no
# division by the groups' standard deviation, which would scale the vanishing differences back up.
NO_REWARD = ["reward.rule_weight=1e-12", "algorithm.norm_adv_by_std_in_grpo=false"]


def reads_demonstrations(config) -> bool:
    """Whether a PPOConfig's update reads demonstrations or the ground truth (not only the reward)."""
    return bool(config.actor.sft_loss_coef) or config.algorithm.guide_failed_groups


def run_controls(
    demo_dir: str | Path,
    recipe: dict,
    *,
    seed: int,
    backend: str = "process",
    train_overrides: list[str] = (),
    sft_overrides: list[str] = (),
    name: str = "",
) -> dict:
    """Run the controls of ``recipe`` (what :func:`run_demo` returned for ``demo_dir``) from its warm start.

    Args:
        demo_dir: the recipe's demo directory (its SFT is reused).
        recipe: the recipe's summary from :func:`run_demo`.
        seed, backend, train_overrides, sft_overrides: as the recipe ran.
        name: a suffix for the controls' run directories (``grpo-no-reward{name}``, ``sft-more{name}``).

    Returns:
        ``{"no_reward_after", "sft_more_after"}``: held-out accuracy after each control (``sft_more_after``
        None where the recipe reads no demonstrations), with ``no_reward_s``/``sft_more_s``, their minutes.
    """
    from rl_extension.config import PPOConfig, load_config

    demo_dir = Path(demo_dir)
    run_dir = demo_dir / f"grpo-no-reward{name}"
    start = time.perf_counter()
    no_reward = run_demo(
        demo_dir,
        seed=seed,
        backend=backend,
        train_overrides=[*train_overrides, *NO_REWARD, f"trainer.run_dir={run_dir}"],
        sft_overrides=list(sft_overrides),
        reuse_sft=True,
    )
    result = {
        "no_reward_after": no_reward["accuracy_after"],
        "no_reward_s": time.perf_counter() - start,
        "sft_more_after": None,
        "sft_more_s": None,
    }
    config = load_config(PPOConfig, preset=str(Path(recipe["run_dir"]) / "config.yaml"))
    if not reads_demonstrations(config):
        return result
    return result | _sft_more(demo_dir, recipe, name)


def _sft_more(demo_dir: Path, recipe: dict, name: str) -> dict:
    """The SFT-continuation control: the warm start's SFT, resumed for the minutes the recipe's GRPO took."""
    import yaml

    from rl_extension.config import SFTConfig, load_config
    from rl_extension.sft import SFTTrainer

    recorded = demo_dir / f"sft-more{name}.yaml"  # the warm start's SFT config as it ran
    recorded.write_text(yaml.safe_dump(recipe["sft_config"], sort_keys=False))
    sft_config = load_config(
        SFTConfig,
        recorded,
        [
            f"model.path={recipe['sft_model']}",
            f"output_dir={demo_dir / f'sft-more{name}'}",
            f"data.val_files=[{recipe['test_file']}]",
            "stop_at_accuracy=0",
            "eval_every=0",
            "total_steps=1000000",
            f"max_minutes={recipe['grpo_s'] / 60:.4f}",
        ],
    )
    start = time.perf_counter()
    with SFTTrainer(sft_config) as sft:
        summary = sft.fit()
    return {"sft_more_after": summary["val/accuracy"], "sft_more_s": time.perf_counter() - start}
