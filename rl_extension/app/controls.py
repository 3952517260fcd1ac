"""The controls of a demo run: what the same warm start learns without the reward, or from SFT alone.

A learning figure says what the reward taught only beside its controls (docs/rl/results.md):

- ``no_reward``: the same recipe with the reward removed (every sample scores about 0, so every
  advantage is about 0). A recipe that learns from the reward alone learns nothing here; one with a
  supervised term (``actor.sft_loss_coef``) or guidance learns what those teach, and the difference
  to the recipe is the reward's own contribution.
- ``sft_more``: SFT continued from the same warm start for the recipe's GRPO minutes (counted in
  SFT steps at the warm start's own step time, so a busy machine favours neither side), on the
  demonstrations the warm start was trained on. It asks whether the RL run beat spending its
  minutes on more supervised training: for a recipe that reads demonstrations, and for one that
  learns from the reward alone where demonstrations exist (every demo's warm start is an SFT).

Used by ``benchmarks/rl/demo_seeds.py --controls`` and ``benchmarks/rl/ablation.py --controls``.
"""

from __future__ import annotations

import time
from pathlib import Path

from rl_extension.app.demo import run_demo

__all__ = ["NO_REWARD", "run_controls", "sft_step_seconds"]

# The reward removed: a vanishing rule weight (the config refuses 0 with no reward model) and no
# division by the groups' standard deviation, which would scale the vanishing differences back up.
NO_REWARD = ["reward.rule_weight=1e-12", "algorithm.norm_adv_by_std_in_grpo=false"]


def run_controls(
    demo_dir: str | Path,
    recipe: dict,
    *,
    seed: int,
    backend: str = "process",
    train_overrides: list[str] = (),
    sft_overrides: list[str] = (),
    name: str = "",
    which: tuple[str, ...] = ("no_reward", "sft_more"),
) -> dict:
    """Run the controls of ``recipe`` (what :func:`run_demo` returned for ``demo_dir``) from its warm start.

    Args:
        demo_dir: the recipe's demo directory (its SFT is reused).
        recipe: the recipe's summary from :func:`run_demo` (its ``task`` and ``use_tool`` are the
            controls' too).
        seed, backend, train_overrides, sft_overrides: as the recipe ran.
        name: a suffix for the controls' run directories (``grpo-no-reward{name}``, ``sft-more{name}``).
        which: the controls to run, of ``"no_reward"`` and ``"sft_more"``.

    Returns:
        ``{"no_reward_after", "sft_more_after"}``: held-out accuracy after each control, with
        ``no_reward_s``/``sft_more_s``, their seconds.
    """
    unknown = sorted(set(which) - {"no_reward", "sft_more"})
    if unknown:
        raise ValueError(f"unknown controls {unknown}; the controls are 'no_reward' and 'sft_more'")
    demo_dir = Path(demo_dir)
    result: dict = {}
    if "no_reward" in which:
        start = time.perf_counter()
        no_reward = run_demo(
            demo_dir,
            seed=seed,
            backend=backend,
            train_overrides=[
                *train_overrides,
                *NO_REWARD,
                f"trainer.run_dir={demo_dir / f'grpo-no-reward{name}'}",
            ],
            sft_overrides=list(sft_overrides),
            task=recipe.get("task", "addition"),  # the recipe's own task: its warm start is reused
            use_tool=recipe.get("use_tool", True),
            reuse_sft=True,
        )
        result |= {"no_reward_after": no_reward["accuracy_after"], "no_reward_s": time.perf_counter() - start}
    if "sft_more" in which:
        result |= _sft_more(demo_dir, recipe, name)
    return result


def sft_step_seconds(metrics_file: str | Path) -> float:
    """The median seconds of one SFT training step in an SFT run's metrics.jsonl (the steps that
    ran an evaluation left out)."""
    import json
    import statistics

    rows = [json.loads(line) for line in Path(metrics_file).read_text().splitlines() if line.strip()]
    gaps = [
        b["timing/elapsed_s"] - a["timing/elapsed_s"]
        for a, b in zip(rows, rows[1:])
        if "val/accuracy" not in b and b["step"] == a["step"] + 1
    ]
    if not gaps:
        raise ValueError(f"{metrics_file}: no consecutive training steps to time")
    return statistics.median(gaps)


def _sft_more(demo_dir: Path, recipe: dict, name: str) -> dict:
    """The SFT-continuation control: the warm start's SFT, resumed for the minutes the recipe's GRPO
    took. The minutes are counted in steps, at the warm start's own SFT step time: a machine that
    is busier during one run than during the other then changes neither side."""
    import yaml

    from rl_extension.config import SFTConfig, load_config
    from rl_extension.trainers.sft import SFTTrainer

    steps = max(
        1, round(recipe["grpo_s"] / sft_step_seconds(Path(recipe["sft_model"]).parent / "metrics.jsonl"))
    )
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
            f"total_steps={steps}",
            "max_minutes=0",
        ],
    )
    start = time.perf_counter()
    with SFTTrainer(sft_config) as sft:
        summary = sft.fit()
    return {
        "sft_more_after": summary["val/accuracy"],
        "sft_more_s": time.perf_counter() - start,
        "sft_more_steps": steps,
    }
