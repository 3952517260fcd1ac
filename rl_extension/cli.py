"""The ``spmdcall-rl`` command (also ``python -m rl_extension``).

    spmdcall-rl train preset=tiny-cpu model.path=runs/sft-tiny-cpu/hf_model trainer.total_steps=200
    spmdcall-rl sft preset=sft-tiny-cpu total_steps=500
    spmdcall-rl plot runs/tiny-cpu
    spmdcall-rl demo [--seed 0] [--backend process]      # SFT warm start -> GRPO -> accuracy before/after
    spmdcall-rl config preset=tiny-cpu [key=value ...]   # print the resolved config
    spmdcall-rl presets                                  # list the shipped presets

``preset=`` names a preset in rl_extension/presets or a YAML file (a run's own config.yaml works);
every other ``key=value`` overrides one config key (``spmdcall-rl config --keys`` lists them all).
``train`` and ``sft`` check the config, the checkpoints and the data files before torch is imported
or a worker starts; any such error, or one met while building the run, is one line (``--debug``
shows the traceback).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

__all__ = ["main", "make_demo_data", "run_demo"]

USAGE_EXAMPLES = """examples:
  spmdcall-rl demo
  spmdcall-rl demo --task calc
  spmdcall-rl sft preset=sft-tiny-cpu output_dir=runs/sft
  spmdcall-rl train preset=tiny-cpu model.path=runs/sft/hf_model trainer.total_steps=200
  spmdcall-rl train preset=tiny-cpu-ppo model.path=runs/sft/hf_model trainer.backend=ray
  spmdcall-rl train preset=runs/tiny-cpu/config.yaml trainer.resume=true
  spmdcall-rl plot runs/tiny-cpu
"""


DEMO_DESCRIPTION = """The whole story on a CPU: a tiny random Qwen2 and 3-digit addition problems on disk,
an SFT warm start (FSDP2, 2 workers), then GRPO from the verifier's reward alone, and the held-out
accuracy before and after. It takes about 10 minutes on a 2-core Intel Xeon, about twice that on a
2-core AVX2 EPYC. A progress bar shows each stage; Ctrl-C stops it with one line saying how to go on
(--resume)."""

_DEBUG_HELP = "show the traceback of an error met while building the run (a data, model or tokenizer problem)"


def _split_preset(items: list[str]) -> tuple[str | None, list[str]]:
    preset, overrides = None, []
    for item in items:
        if item.startswith("preset="):
            preset = item.partition("=")[2]
        elif "=" not in item:
            raise SystemExit(f"spmdcall-rl: expected key=value, got {item!r} (see spmdcall-rl config --keys)")
        else:
            overrides.append(item)
    return preset, overrides


def _load(cls: type, items: list[str], command: str = ""):
    """The config of ``preset=``/``key=value`` items; a bad key or value exits with its message, and a
    preset of the other command (an SFT preset given to ``train``) says which command takes it."""
    from rl_extension.config import load_config

    preset, overrides = _split_preset(items)
    try:
        return load_config(cls, preset, overrides)
    except ValueError as exc:
        hint = _other_command(cls, preset, command)
        raise SystemExit(f"spmdcall-rl: config error: {exc}{hint}") from None


def _other_command(cls: type, preset: str | None, command: str) -> str:
    """``; PRESET is an SFT preset: run ...`` when ``preset`` loads as the other kind of config."""
    from rl_extension.config import PPOConfig, SFTConfig, load_config

    if preset is None:
        return ""
    other = SFTConfig if cls is PPOConfig else PPOConfig
    try:
        load_config(other, preset)
    except (ValueError, OSError):
        return ""
    if other is SFTConfig:
        what, run = "an SFT preset", f"spmdcall-rl sft preset={preset}"
        run += " (spmdcall-rl config --sft to print it)" if command == "config" else ""
        run += f" (the demo takes it as sft.preset={preset})" if command == "demo" else ""
    else:
        what, run = "a GRPO/PPO preset", f"spmdcall-rl train preset={preset}"
        run += " (spmdcall-rl config without --sft to print it)" if command == "config" else ""
    return f"; {preset!r} is {what}: run {run}"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C in a stage of the demo: the stage and what it left (``run_demo`` raises it)."""


@contextmanager
def _on_ctrl_c(debug: bool, where: Callable[[KeyboardInterrupt], str]) -> Iterator[None]:
    """Ctrl-C ends the command with one line from ``where(interrupt)`` (what was interrupted, the last
    checkpoint, how to go on) and exit status 130; the ``with`` blocks inside have shut the worker
    groups down on the way out. ``--debug`` shows the traceback instead."""
    try:
        yield
    except KeyboardInterrupt as interrupt:
        if debug:
            raise
        print(f"\nspmdcall-rl: interrupted {where(interrupt)}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def _train_interrupted(trainer: Any) -> str:
    """Where an interrupted GRPO/PPO run stopped and its last checkpoint."""
    from rl_extension.trainer import latest_checkpoint

    if trainer is None:
        return "while the run was being built, before its first step"
    checkpoint = latest_checkpoint(trainer.run_dir)
    saved = f"last checkpoint {checkpoint}" if checkpoint else "no checkpoint yet"
    return f"at step {trainer.step} of {trainer.config.trainer.total_steps}; {saved}"


def _check_inputs(config) -> None:
    """A missing checkpoint or data file exits with its key and path, before torch is imported."""
    from rl_extension.inputs import check_inputs

    try:
        check_inputs(config)
    except ValueError as exc:
        raise SystemExit(f"spmdcall-rl: error: {exc}") from None


@contextmanager
def _one_line_errors(debug: bool) -> Iterator[None]:
    """Data, model and tokenizer problems met while building a run exit with one line (``--debug``: the
    traceback). A worker that fails to start is reported by its rank and its exception's last line."""
    import spmdcall as sc

    try:
        yield
    except (ValueError, OSError, ImportError, sc.WorkerError) as exc:
        if debug:
            raise
        message = str(exc).splitlines()[0] if isinstance(exc, sc.WorkerError) else " ".join(str(exc).split())
        raise SystemExit(
            f"spmdcall-rl: error: {message or type(exc).__name__} (--debug shows the traceback)"
        ) from None


def _quiet_hf() -> None:
    # Hugging Face prints a progress bar per model load/save; the trainer prints its own progress.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def cmd_train(items: list[str], debug: bool = False) -> int:
    from rl_extension.config import PPOConfig

    config = _load(PPOConfig, items, "train")
    _check_inputs(config)
    trainer = None

    def where(_: KeyboardInterrupt) -> str:
        if trainer is None:
            return _train_interrupted(trainer)
        resume = f"spmdcall-rl train preset={trainer.run_dir / 'config.yaml'} trainer.resume=true"
        return f"{_train_interrupted(trainer)}; resume with: {resume}"

    with _on_ctrl_c(debug, where):
        with _one_line_errors(debug):
            from rl_extension.trainer import PPOTrainer  # torch loads here, once the config checks out

            _quiet_hf()
            trainer = PPOTrainer(config)
        with trainer:
            metrics = trainer.fit()
    print(
        f"done: {trainer.step} steps in {trainer.run_dir}"
        + (f"; held-out accuracy {metrics['val/accuracy']:.3f}" if "val/accuracy" in metrics else "")
    )
    return 0


def cmd_sft(items: list[str], debug: bool = False) -> int:
    from rl_extension.config import SFTConfig

    config = _load(SFTConfig, items, "sft")
    _check_inputs(config)
    again = "spmdcall-rl sft " + " ".join(items)
    nothing = "nothing saved (SFT writes its model at the end)"
    with _on_ctrl_c(debug, lambda _: f"during SFT; {nothing}; run it again: {again}"):
        with _one_line_errors(debug):
            from rl_extension.sft import SFTTrainer  # torch loads here, once the config checks out

            _quiet_hf()
            trainer = SFTTrainer(config)
        with trainer:
            summary = trainer.fit()
    accuracy = f"; held-out accuracy {summary['val/accuracy']:.3f}" if "val/accuracy" in summary else ""
    print(f"done: Hugging Face checkpoint in {summary['hf_model']}{accuracy}")
    return 0


def cmd_config(items: list[str], show_keys: bool, sft: bool) -> int:
    from rl_extension.config import PPOConfig, SFTConfig, config_keys, field_docs, to_yaml

    cls = SFTConfig if sft else PPOConfig
    if show_keys:
        for key in config_keys(cls):
            section_cls = cls
            *path, name = key.split(".")
            for part in path:
                section_cls = type(getattr(section_cls(), part))
            print(f"{key:50s} {field_docs(section_cls).get(name, '')}")
        return 0
    print(to_yaml(_load(cls, items, "config")), end="")
    return 0


# How the demo names the RL stage, by algorithm.adv_estimator.
_ALGORITHM_NAMES = {"grpo": "GRPO", "rloo": "RLOO", "reinforce_plus_plus": "REINFORCE++", "gae": "PPO"}


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

    from rl_extension.data import make_task_splits

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
    helpers = []
    if config.actor.sft_loss_coef:
        helpers.append(f"a supervised term on {demo} (actor.sft_loss_coef={config.actor.sft_loss_coef:g})")
    if config.algorithm.guide_failed_groups:
        helpers.append(f"guidance: {demo} written into groups with no right answer")
    scorer = f"the {config.reward.scorer!r} verifier" if config.reward.scorer else "each task's verifier"
    what = "a reward model" if config.reward.model_path and not config.reward.rule_weight else scorer
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
        "learned_from"}``, and what a control run needs (``sft_model``, ``sft_train_file``, ``test_file``,
        ``sft_config``: see ``rl_extension.controls``).
    """
    out = Path(out).resolve()
    print(f"[demo] the {task} demo, in {out}: loading torch and transformers", flush=True)
    from rl_extension.config import PPOConfig, SFTConfig, load_config, to_dict
    from rl_extension.metrics import read_jsonl
    from rl_extension.models import build_tiny_model
    from rl_extension.plot import plot_run
    from rl_extension.sft import SFTTrainer
    from rl_extension.trainer import PPOTrainer

    _quiet_hf()
    start = time.perf_counter()
    train_preset, train_overrides = _split_preset(list(train_overrides))
    sft_preset, sft_overrides = _split_preset(list(sft_overrides))
    calc = task == "calc"
    if not calc and task != "addition":
        raise ValueError(f"the demo's task is addition or calc, got {task!r}")
    train_preset = train_preset or ("calc-cpu" if calc else "tiny-cpu")
    sft_preset = sft_preset or ("sft-calc-cpu" if calc else "sft-tiny-cpu")
    tool = calc and use_tool
    if calc:  # the same presets without the tool: answers in the model's head, one turn
        train_overrides = [*([] if tool else ["rollout.multi_turn.enable=false"]), *train_overrides]
        sft_overrides = [*([] if tool else ["multi_turn.enable=false"]), *sft_overrides]
    sft_base = load_config(SFTConfig, sft_preset, [f"model.tiny.seed={seed}", *sft_overrides])
    tiny = sft_base.model.tiny
    model_path = build_tiny_model(out / "tiny_model", **asdict(tiny))
    # The problems: the SFT preset's task settings (sft.data.synthetic.task_kwargs=... changes them).
    task_kwargs = dict(sft_base.data.synthetic.task_kwargs)
    files = make_demo_data(out / "data", task=task, **task_kwargs)
    sft_files = {"train": files["train"], "dev": files["dev"]}
    if tool:  # SFT learns from demonstrations of the tool, graded with it
        from rl_extension.agents import TagFormat
        from rl_extension.agents.calc import write_calc_demonstrations
        from rl_extension.models import load_tokenizer

        eos = load_tokenizer(model_path).eos_token
        sft_files["train"] = write_calc_demonstrations(
            files["train"], out / "data" / "demos.parquet", TagFormat(), eos
        )
        # GRPO's prompts carry them too, for algorithm.guide_failed_groups=true or actor.sft_loss_coef
        # (off in the presets; the demonstration column is read only when one of them is on).
        files["train"] = write_calc_demonstrations(
            files["train"], out / "data" / "train_demos.parquet", TagFormat(), eos, column="demonstration"
        )
        train_overrides = ["data.demonstration_key=demonstration", *train_overrides]
    what = f"{task_kwargs['num_digits']}-digit {'multiplication' if task_kwargs.get('op') == '*' else 'addition'}"
    what += (" with the calc tool" if tool else ", no tool") if calc else ""
    print(
        f"[demo 1/4] tiny Qwen2 ({tiny.num_layers} layers x {tiny.hidden_size}) and {what} data in {out}",
        flush=True,
    )

    sft_config = load_config(
        SFTConfig,
        sft_preset,
        [
            f"backend={backend}",
            f"seed={seed}",
            f"model.path={model_path}",
            f"output_dir={out / 'sft'}",
            f"data.train_files=[{sft_files['train']}]",
            f"data.val_files=[{sft_files['dev']}]",
            *sft_overrides,
        ],
    )
    print(
        f"[demo 2/4] SFT warm start on {sft_config.num_workers} FSDP2 workers until the dev accuracy reaches "
        f"{sft_config.stop_at_accuracy:.0%} (at most {sft_config.total_steps} steps)",
        flush=True,
    )
    done_file = out / "sft" / "demo_sft.json"  # written after a finished SFT, with its config
    done = json.loads(done_file.read_text()) if (reuse_sft or resume) and done_file.exists() else {}
    if done.get("config") == to_dict(sft_config):
        sft_summary, sft_s = done["summary"], done["sft_s"]
        print(f"[demo 2/4] reusing the finished SFT in {out / 'sft'} ({sft_s / 60:.1f} min when it ran)")
    else:
        done_file.unlink(missing_ok=True)
        try:
            with SFTTrainer(sft_config) as sft:
                sft_summary = sft.fit()
        except KeyboardInterrupt:
            raise Interrupted("during the demo's SFT, which writes its model only at the end") from None
        sft_s = time.perf_counter() - start
        done = {"config": to_dict(sft_config), "summary": sft_summary, "sft_s": sft_s}
        done_file.write_text(json.dumps(done))
    start = time.perf_counter() - sft_s  # GRPO and total minutes count the SFT's own minutes

    ppo_config = load_config(
        PPOConfig,
        train_preset,
        [
            f"trainer.backend={backend}",
            f"trainer.seed={seed}",
            f"model.path={sft_summary['hf_model']}",
            f"trainer.run_dir={out / 'grpo'}",
            "trainer.overwrite=true",
            *(["trainer.resume=true"] if resume else []),
            "trainer.val_before_train=true",
            f"data.train_files=[{files['train']}]",
            f"data.val_files=[{files['test']}]",
            *train_overrides,
        ],
    )
    algo = _ALGORITHM_NAMES[ppo_config.algorithm.adv_estimator]
    print(
        f"[demo 3/4] {algo}: {ppo_config.trainer.total_steps} steps x {ppo_config.data.train_batch_size} prompts x "
        f"{ppo_config.rollout.n} samples on {ppo_config.trainer.num_workers} workers ({backend} backend)",
        flush=True,
    )
    print(f"[demo 3/4] learned from: {learned_from(ppo_config)}", flush=True)
    trainer = None
    try:
        with PPOTrainer(ppo_config) as trainer:
            trainer.fit()
    except KeyboardInterrupt:
        raise Interrupted(f"during the demo's {algo}, {_train_interrupted(trainer)}") from None
    grpo_s = time.perf_counter() - start - sft_s

    val = [r for r in read_jsonl(trainer.run_dir / "metrics.jsonl") if "val/accuracy" in r]
    before, after = val[0]["val/accuracy"], val[-1]["val/accuracy"]
    tool_use = {k.removeprefix("val/agent/"): v for k, v in val[-1].items() if k.startswith("val/agent/")}
    plot = plot_run(trainer.run_dir)
    total_s = time.perf_counter() - start
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
        # What a control run from the same warm start needs (rl_extension.controls).
        "sft_model": sft_summary["hf_model"],
        "sft_train_file": sft_files["train"],
        "test_file": files["test"],
        "sft_config": to_dict(sft_config),
        **{f"val_{k}": v for k, v in tool_use.items()},
    }


def main(argv: list[str] | None = None) -> int:
    """``spmdcall-rl``; a Ctrl-C that no command met (while it was starting) is one line too."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        if "--debug" in (sys.argv[1:] if argv is None else argv):
            raise
        print("\nspmdcall-rl: interrupted while the command was starting; nothing ran", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="spmdcall-rl",
        description="PPO/GRPO training on spmdcall worker groups.",
        epilog=USAGE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="PPO/GRPO training: [preset=NAME|FILE] [key=value ...]")
    p.add_argument("items", nargs="*", metavar="key=value")
    p.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    p = sub.add_parser("sft", help="supervised fine-tuning (warm start): [preset=NAME|FILE] [key=value ...]")
    p.add_argument("items", nargs="*", metavar="key=value")
    p.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    p = sub.add_parser("plot", help="plot RUN_DIR/metrics.jsonl to a PNG")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="the PNG to write (default RUN_DIR/plots/metrics.png)")
    p = sub.add_parser(
        "demo",
        help="tiny model -> addition data -> SFT -> GRPO, accuracy before and after",
        description=DEMO_DESCRIPTION,
    )
    p.add_argument("--debug", action="store_true", help="show the traceback of an error or a Ctrl-C")
    p.add_argument(
        "items",
        nargs="*",
        metavar="key=value",
        help="overrides of the GRPO config; sft.<key>=value overrides the SFT config; "
        "preset=NAME and sft.preset=NAME replace the presets (tiny-cpu, sft-tiny-cpu)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output directory (default runs/demo-seed<SEED>; runs/demo-calc-seed<SEED> with --task calc, "
        "runs/demo-calc-notool-seed<SEED> with --no-tool)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="go on after an interrupted demo: keep its finished SFT, continue GRPO from its last checkpoint",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="process", help="process (default) or ray")
    p.add_argument(
        "--task",
        default="addition",
        choices=["addition", "calc"],
        help="addition (3 digits, default) or calc (4-digit multiplication with the calc tool: "
        "multi-turn rollouts)",
    )
    p.add_argument("--no-tool", action="store_true", help="--task calc without the tool (the baseline)")
    p = sub.add_parser("config", help="print the resolved config: [preset=NAME|FILE] [key=value ...]")
    p.add_argument("items", nargs="*", metavar="key=value")
    p.add_argument("--keys", action="store_true", help="list every key with its documentation")
    p.add_argument("--sft", action="store_true", help="the SFT config instead of the PPO one")
    sub.add_parser("presets", help="list the shipped presets")
    args = parser.parse_args(argv)

    if args.command == "train":
        return cmd_train(args.items, args.debug)
    if args.command == "sft":
        return cmd_sft(args.items, args.debug)
    if args.command == "plot":
        from rl_extension.plot import plot_run

        print(plot_run(args.run_dir, args.out))
        return 0
    if args.command == "demo":
        sft_items = [i.removeprefix("sft.") for i in args.items if i.startswith("sft.")]
        train_items = [i for i in args.items if not i.startswith("sft.")]
        # trainer.backend=... picks the backend of both stages, like --backend.
        backend = next(
            (i.partition("=")[2] for i in train_items if i.startswith("trainer.backend=")), args.backend
        )
        task = "" if args.task == "addition" else f"{args.task}-" + ("notool-" if args.no_tool else "")
        again = " ".join(["spmdcall-rl demo", *(a for a in (argv or sys.argv[1:])[1:] if a != "--resume")])

        def where(interrupt: KeyboardInterrupt) -> str:
            return f"{str(interrupt) or 'while the demo was setting up'}; go on with: {again} --resume"

        with _on_ctrl_c(args.debug, where):
            run_demo(
                args.out or f"runs/demo-{task}seed{args.seed}",
                seed=args.seed,
                backend=backend,
                train_overrides=train_items,
                sft_overrides=sft_items,
                task=args.task,
                use_tool=not args.no_tool,
                resume=args.resume,
            )
        return 0
    if args.command == "config":
        return cmd_config(args.items, args.keys, args.sft)
    from rl_extension.config import PRESET_DIR, preset_names  # presets

    names = preset_names()
    width = max(map(len, names)) + 2
    columns = max(shutil.get_terminal_size().columns, width + 40)
    for name in names:
        summary = _first_sentence(PRESET_DIR / f"{name}.yaml")
        print(
            textwrap.fill(summary, columns, initial_indent=f"{name:{width}}", subsequent_indent=" " * width)
        )
    return 0


def _first_sentence(preset: Path) -> str:
    """The first sentence of a preset's header comment, which may span several comment lines."""
    lines = []
    for line in preset.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    match = re.match(r".*?[.!?](?=\s|$)", text)
    return match.group(0) if match else text


if __name__ == "__main__":
    sys.exit(main())
