"""The demo: a tiny model learns 3-digit addition (or the calc tool) by SFT then GRPO, on a laptop CPU.

``spmdcall-rl demo`` runs ``run_demo``; the benchmarks and the controls (``rl_extension.app.controls``)
call it too. torch and transformers load inside ``run_demo``, not when this module is imported.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rl_extension.algorithms.advantages import get_advantage_estimator
from rl_extension.config.presets import split_preset

__all__ = ["Interrupted", "algorithm_name", "learned_from", "make_demo_data", "run_demo"]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C in a stage of the demo: the stage and what it left (``run_demo`` raises it)."""


def algorithm_name(config) -> str:
    """How the demo names a GRPO/PPO config's RL stage: its advantage estimator's display name (GRPO, PPO)."""
    return get_advantage_estimator(config.algorithm.adv_estimator).display_name


def make_demo_data(
    out: str | Path,
    *,
    num_train: int = 20000,
    num_dev: int = 256,
    num_test: int = 256,
    num_digits: int = 3,
    seed: int = 0,
    task: str = "addition",
    **task_kwargs: Any,
) -> dict[str, str]:
    """Distinct addition problems for the demo, split three ways: ``train``, ``dev`` (SFT's early stop)
    and ``test`` (held out: the accuracy before and after GRPO). No problem is in two splits.
    ``task="calc"`` writes the same problems for the calc tool (graded by the ``calc`` scorer);
    ``task_kwargs`` go to the task's row generator (e.g. ``op="*"`` for calc)."""
    import pyarrow.parquet as pq

    from rl_extension.data.prompts import make_task_splits

    out = Path(out)
    train_dev, test = make_task_splits(
        task, out / "all", num_train + num_dev, num_test, seed=seed, num_digits=num_digits, **task_kwargs
    )
    table = pq.read_table(train_dev)
    files = {"train": str(out / "train.parquet"), "dev": str(out / "dev.parquet"), "test": test}
    pq.write_table(table.slice(0, num_train), files["train"])
    pq.write_table(table.slice(num_train), files["dev"])
    return files


def learned_from(config) -> str:
    """What a GRPO/PPO config's update learns from, in words: the reward alone, or the reward with a
    supervised term on the demonstrations and/or guidance (which write the answers into the update)."""
    demo = (
        f"the {config.data.demonstration_key!r} column"
        if config.data.demonstration_key
        else "the ground truth"
    )
    sft = f"a supervised term on {demo} (actor.sft_loss_coef={config.actor.sft_loss_coef:g})"
    helpers = [sft] if config.actor.sft_loss_coef else []
    if config.algorithm.guide_failed_groups:
        helpers.append(f"guidance: {demo} written into groups with no right answer")
    scorer = f"the {config.reward.scorer!r} verifier" if config.reward.scorer else "each task's verifier"
    what = "a reward model" if config.reward.model_path and not config.reward.rule_weight else scorer
    if not config.reward.model_path and abs(config.reward.rule_weight) < 1e-6:  # the reward-removed control
        removed = f"no reward ({what} weighted {config.reward.rule_weight:g}, the reward removed)"
        trains = f"only {sft}" if config.actor.sft_loss_coef else "nothing should train"
        if config.algorithm.guide_failed_groups:  # no sample scores 1: every group is guided, at advantage ~0
            trains += (
                f"; guidance writes {demo} into every group, where its advantage is ~0 as every sample's"
            )
        return f"{removed}: {trains}"
    if not helpers:
        return f"the reward alone ({what}); no answer or demonstration enters the update"
    return f"the reward ({what}) plus " + " and ".join(helpers)


def run_demo(
    out: str | Path = "runs/demo",
    *,
    seed: int = 0,
    backend: str = "process",
    train_overrides: list[str] = (),
    sft_overrides: list[str] = (),
    task: str = "addition",
    use_tool: bool = True,
    reuse_sft: bool = False,
    resume: bool = False,
) -> dict:
    """The whole story on a laptop CPU: tiny model -> addition data -> SFT -> GRPO -> accuracy before/after.

    ``task="calc"``: 4-digit multiplication with the ``calc`` tool (the SFT preset's
    ``data.synthetic.task_kwargs``): SFT on demonstrations of the tool (presets sft-calc-cpu,
    calc-cpu), then GRPO with multi-turn rollouts; ``use_tool=False`` trains the same model on the
    same problems without the tool (answers in its head), for comparison. The presets learn from the
    reward alone; the report's ``learned from`` line says what entered the update.

    Args:
        out: directory for everything the demo writes.
        seed: seeds the model's initialisation, SFT and GRPO (data order, sampling); the problems stay the same.
        backend: spmdcall backend of both groups (process or ray).
        train_overrides: ``key=value`` for the GRPO config; ``preset=NAME`` replaces its preset, tiny-cpu.
        sft_overrides: ``key=value`` for the SFT config; ``preset=NAME`` replaces its preset, sft-tiny-cpu.
        task: ``addition`` (3-digit, no tool) or ``calc`` (4-digit multiplication, with the calc tool).
        use_tool: with ``calc``, give the model the tool (False: the baseline without it).
        reuse_sft: keep a finished SFT of the same config in ``out/sft`` instead of running it again
            (SFT is deterministic per seed on one machine); its steps and minutes are the recorded ones.
        resume: go on after an interrupted demo: keep a finished SFT (as ``reuse_sft``) and continue GRPO
            from its last checkpoint in ``out/grpo`` (its minutes then count the resumed part only).

    Raises:
        Interrupted: on Ctrl-C (a ``KeyboardInterrupt`` saying which stage stopped and what it left).

    Returns:
        ``{"accuracy_before", "accuracy_after", "sft_steps", "sft_s", "grpo_s", "total_s", "plot", "run_dir",
        "learned_from"}``, and what a control run needs (``task``, ``use_tool``, ``sft_model``,
        ``sft_train_file``, ``test_file``, ``sft_config``: see ``rl_extension.app.controls``).
    """
    out = Path(out).resolve()
    print(f"[demo] the {task} demo, in {out}: loading torch and transformers", flush=True)
    from rl_extension.models import disable_progress_bars

    disable_progress_bars()
    start = time.perf_counter()
    plan = _plan(task, use_tool, list(train_overrides), list(sft_overrides))
    _prepare(out, plan, seed)
    sft_config, sft_summary, sft_s = _warm_start(out, plan, seed, backend, reuse_sft or resume, start)
    start = time.perf_counter() - sft_s  # GRPO and total minutes count the SFT's own minutes
    trainer, ppo_config = _train(out, plan, sft_summary["hf_model"], seed, backend, resume)
    grpo_s = time.perf_counter() - start - sft_s
    return _report(trainer, ppo_config, plan, sft_config, sft_summary, sft_s, grpo_s, start)


@dataclass
class _Plan:
    """What the demo runs: presets and overrides of both stages, then the files it wrote for them."""

    task: str
    tool: bool
    train_preset: str
    sft_preset: str
    train_overrides: list[str]
    sft_overrides: list[str]
    model_path: str = ""
    files: dict[str, str] = field(default_factory=dict)
    sft_files: dict[str, str] = field(default_factory=dict)


def _plan(task: str, use_tool: bool, train_items: list[str], sft_items: list[str]) -> _Plan:
    """The presets and overrides of both stages (``preset=NAME`` among the items replaces a preset)."""
    train_preset, train_overrides = split_preset(train_items)
    sft_preset, sft_overrides = split_preset(sft_items)
    calc = task == "calc"
    if not calc and task != "addition":
        raise ValueError(f"the demo's task is addition or calc, got {task!r}")
    tool = calc and use_tool
    if calc:  # the same presets without the tool: answers in the model's head, one turn
        train_overrides = [*([] if tool else ["rollout.multi_turn.enable=false"]), *train_overrides]
        sft_overrides = [*([] if tool else ["multi_turn.enable=false"]), *sft_overrides]
    return _Plan(
        task,
        tool,
        train_preset or ("calc-cpu" if calc else "tiny-cpu"),
        sft_preset or ("sft-calc-cpu" if calc else "sft-tiny-cpu"),
        train_overrides,
        sft_overrides,
    )


def _prepare(out: Path, plan: _Plan, seed: int) -> None:
    """Stage 1: the tiny model and the problems (with the tool's demonstrations), into ``plan``."""
    from rl_extension.config import SFTConfig, load_config
    from rl_extension.models import build_tiny_model

    sft_base = load_config(SFTConfig, plan.sft_preset, [f"model.tiny.seed={seed}", *plan.sft_overrides])
    tiny = sft_base.model.tiny
    plan.model_path = build_tiny_model(out / "tiny_model", **asdict(tiny))
    # The problems: the SFT preset's task settings (sft.data.synthetic.task_kwargs=... changes them).
    task_kwargs = dict(sft_base.data.synthetic.task_kwargs)
    plan.files = make_demo_data(out / "data", task=plan.task, **task_kwargs)
    plan.sft_files = {"train": plan.files["train"], "dev": plan.files["dev"]}
    if plan.tool:  # SFT learns from demonstrations of the tool, graded with it
        from rl_extension.agents import TagFormat
        from rl_extension.agents.calc import write_calc_demonstrations
        from rl_extension.models import load_tokenizer

        eos = load_tokenizer(plan.model_path).eos_token
        train = plan.files["train"]
        plan.sft_files["train"] = write_calc_demonstrations(
            train, out / "data" / "demos.parquet", TagFormat(), eos
        )
        # GRPO's prompts carry them too, for algorithm.guide_failed_groups=true or actor.sft_loss_coef
        # (off in the presets; the demonstration column is read only when one of them is on).
        plan.files["train"] = write_calc_demonstrations(
            train, out / "data" / "train_demos.parquet", TagFormat(), eos, column="demonstration"
        )
        plan.train_overrides = ["data.demonstration_key=demonstration", *plan.train_overrides]
    what = f"{task_kwargs['num_digits']}-digit {'multiplication' if task_kwargs.get('op') == '*' else 'addition'}"
    what += (" with the calc tool" if plan.tool else ", no tool") if plan.task == "calc" else ""
    print(
        f"[demo 1/4] tiny Qwen2 ({tiny.num_layers} layers x {tiny.hidden_size}) and {what} data in {out}",
        flush=True,
    )


def _warm_start(
    out: Path, plan: _Plan, seed: int, backend: str, reuse: bool, start: float
) -> tuple[Any, dict, float]:
    """Stage 2: SFT until the dev accuracy is reached, or a finished SFT of the same config when ``reuse``;
    returns its config, its summary and its seconds (counted from ``start``)."""
    from rl_extension.config import SFTConfig, load_config, to_dict
    from rl_extension.trainers.sft import SFTTrainer

    sft_config = load_config(
        SFTConfig,
        plan.sft_preset,
        [
            f"backend={backend}",
            f"seed={seed}",
            f"model.path={plan.model_path}",
            f"output_dir={out / 'sft'}",
            f"data.train_files=[{plan.sft_files['train']}]",
            f"data.val_files=[{plan.sft_files['dev']}]",
            *plan.sft_overrides,
        ],
    )
    print(
        f"[demo 2/4] SFT warm start on {sft_config.num_workers} FSDP2 workers until the dev accuracy reaches "
        f"{sft_config.stop_at_accuracy:.0%} (at most {sft_config.total_steps} steps)",
        flush=True,
    )
    done_file = out / "sft" / "demo_sft.json"  # written after a finished SFT, with its config
    done = json.loads(done_file.read_text()) if reuse and done_file.exists() else {}
    if done.get("config") == to_dict(sft_config):
        print(
            f"[demo 2/4] reusing the finished SFT in {out / 'sft'} ({done['sft_s'] / 60:.1f} min when it ran)"
        )
        return sft_config, done["summary"], done["sft_s"]
    done_file.unlink(missing_ok=True)
    try:
        with SFTTrainer(sft_config) as sft:
            sft_summary = sft.fit()
    except KeyboardInterrupt:
        raise Interrupted("during the demo's SFT, which writes its model only at the end") from None
    sft_s = time.perf_counter() - start
    done_file.write_text(json.dumps({"config": to_dict(sft_config), "summary": sft_summary, "sft_s": sft_s}))
    return sft_config, sft_summary, sft_s


def _train(out: Path, plan: _Plan, model_path: str, seed: int, backend: str, resume: bool) -> tuple[Any, Any]:
    """Stage 3: GRPO (or the preset's algorithm) from the warm start; returns the trainer and its config."""
    from rl_extension.config import PPOConfig, load_config
    from rl_extension.trainers.async_ppo import make_trainer
    from rl_extension.trainers.run_dir import describe_stop

    ppo_config = load_config(
        PPOConfig,
        plan.train_preset,
        [
            f"trainer.backend={backend}",
            f"trainer.seed={seed}",
            f"model.path={model_path}",
            f"trainer.run_dir={out / 'grpo'}",
            "trainer.overwrite=true",
            *(["trainer.resume=true"] if resume else []),
            "trainer.val_before_train=true",
            f"data.train_files=[{plan.files['train']}]",
            f"data.val_files=[{plan.files['test']}]",
            *plan.train_overrides,
        ],
    )
    algo = algorithm_name(ppo_config)
    print(
        f"[demo 3/4] {algo}: {ppo_config.trainer.total_steps} steps x {ppo_config.data.train_batch_size} prompts x "
        f"{ppo_config.rollout.n} samples on {ppo_config.trainer.num_workers} workers ({backend} backend)",
        flush=True,
    )
    print(f"[demo 3/4] learned from: {learned_from(ppo_config)}", flush=True)
    trainer = None
    try:
        with make_trainer(ppo_config) as trainer:  # trainer.mode=async: the asynchronous trainer
            trainer.fit()
    except KeyboardInterrupt:
        raise Interrupted(f"during the demo's {algo}, {describe_stop(trainer)}") from None
    return trainer, ppo_config


def _report(
    trainer: Any,
    ppo_config: Any,
    plan: _Plan,
    sft_config: Any,
    sft_summary: dict,
    sft_s: float,
    grpo_s: float,
    start: float,
) -> dict:
    """Stage 4: the held-out accuracy before and after, printed and returned with what a control needs."""
    from rl_extension.app.plot import plot_run
    from rl_extension.config import to_dict
    from rl_extension.trainers.metrics import read_jsonl

    val = [r for r in read_jsonl(trainer.run_dir / "metrics.jsonl") if "val/accuracy" in r]
    before, after = val[0]["val/accuracy"], val[-1]["val/accuracy"]
    tool_use = {k.removeprefix("val/agent/"): v for k, v in val[-1].items() if k.startswith("val/agent/")}
    plot = plot_run(trainer.run_dir)
    total_s = time.perf_counter() - start
    algo = algorithm_name(ppo_config)
    before_line = f"  after SFT ({sft_summary['steps']} steps), before {algo}: "
    after_line = f"  after {algo} ({trainer.step} steps): ".ljust(len(before_line))
    print(
        f"[demo 4/4] held-out exact-match accuracy on {sum(len(b) for b in trainer.val_batches)} unseen problems:\n"
        f"{before_line}{100 * before:5.1f}%\n"
        f"{after_line}{100 * after:5.1f}%   ({100 * (after - before):+.1f} points)\n"
        + (
            f"  tool use on them: {tool_use['tool_calls_per_traj']:.2f} calls per problem, "
            f"{100 * tool_use['tool_error_rate']:.1f}% of calls failed\n"
            if tool_use
            else ""
        )
        + f"  learned from: {learned_from(ppo_config)}\n"
        f"  time: SFT {sft_s / 60:.1f} min, {algo} {grpo_s / 60:.1f} min, total {total_s / 60:.1f} min\n"
        f"  plot: {plot}",
        flush=True,
    )
    return {
        "accuracy_before": before,
        "accuracy_after": after,
        "sft_steps": sft_summary["steps"],
        "sft_s": sft_s,
        "grpo_s": grpo_s,
        "total_s": total_s,
        "plot": plot,
        "run_dir": str(trainer.run_dir),
        "learned_from": learned_from(ppo_config),
        # What a control run from the same warm start needs (rl_extension.app.controls).
        "task": plan.task,
        "use_tool": plan.tool,
        "sft_model": sft_summary["hf_model"],
        "sft_train_file": plan.sft_files["train"],
        "test_file": plan.files["test"],
        "sft_config": to_dict(sft_config),
        **{f"val_{k}": v for k, v in tool_use.items()},
    }
