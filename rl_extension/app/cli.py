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
import re
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rl_extension.app.demo import make_demo_data, run_demo
from rl_extension.config.presets import split_preset
from rl_extension.trainers.run_dir import describe_stop

__all__ = ["main", "make_demo_data", "run_demo"]

USAGE_EXAMPLES = """examples:
  spmdcall-rl demo
  spmdcall-rl demo --task calc
  spmdcall-rl sft preset=sft-tiny-cpu output_dir=runs/sft
  spmdcall-rl train preset=tiny-cpu model.path=runs/sft/hf_model trainer.total_steps=200
  spmdcall-rl train preset=tiny-cpu-ppo model.path=runs/sft/hf_model trainer.backend=ray
  spmdcall-rl train preset=runs/tiny-cpu/config.yaml trainer.resume=true
  spmdcall-rl plot runs/tiny-cpu
  spmdcall-rl scale runs/tiny-cpu-async --rollout-workers 3
"""


DEMO_DESCRIPTION = """The whole story on a CPU: a tiny random Qwen2 and 3-digit addition problems on disk,
an SFT warm start (FSDP2, 2 workers), then GRPO from the verifier's reward alone, and the held-out
accuracy before and after. It takes about 10 minutes on a 2-core Intel Xeon with AMX, 14-22 on one
with AVX-512 only, about 20 on a 2-core AVX2 EPYC. A progress bar shows each stage; Ctrl-C stops it
with one line saying how to go on (--resume)."""

_DEBUG_HELP = "show the traceback of an error met while building the run (a data, model or tokenizer problem)"


def _split_preset(items: list[str]) -> tuple[str | None, list[str]]:
    """``preset=`` and the ``key=value`` overrides of the items; anything else exits with its message."""
    try:
        return split_preset(items)
    except ValueError as exc:
        raise SystemExit(f"spmdcall-rl: {exc}") from None


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


def _check_inputs(config) -> None:
    """A missing checkpoint or data file exits with its key and path, before torch is imported."""
    from rl_extension.data.inputs import check_inputs

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


def cmd_train(items: list[str], debug: bool = False) -> int:
    from rl_extension.config import PPOConfig

    config = _load(PPOConfig, items, "train")
    _check_inputs(config)
    trainer = None

    def where(_: KeyboardInterrupt) -> str:
        if trainer is None:
            return describe_stop(trainer)
        resume = f"spmdcall-rl train preset={trainer.run_dir / 'config.yaml'} trainer.resume=true"
        return f"{describe_stop(trainer)}; resume with: {resume}"

    with _on_ctrl_c(debug, where):
        with _one_line_errors(debug):
            # torch loads here, once the config checks out
            from rl_extension.models import disable_progress_bars
            from rl_extension.trainers.async_ppo import make_trainer

            disable_progress_bars()
            trainer = make_trainer(config)
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
            from rl_extension.models import disable_progress_bars
            from rl_extension.trainers.sft import SFTTrainer  # torch loads here, once the config checks out

            disable_progress_bars()
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
    args = _parser().parse_args(argv)
    if args.command == "train":
        return cmd_train(args.items, args.debug)
    if args.command == "sft":
        return cmd_sft(args.items, args.debug)
    if args.command == "plot":
        from rl_extension.app.plot import plot_run, plot_timeline

        print(plot_run(args.run_dir, args.out))
        if (Path(args.run_dir) / "timeline.jsonl").exists():  # an asynchronous run's
            print(plot_timeline(args.run_dir))
        return 0
    if args.command == "demo":
        return cmd_demo(args, argv)
    if args.command == "config":
        return cmd_config(args.items, args.keys, args.sft)
    if args.command == "scale":
        return cmd_scale(args.run_dir, args.rollout_workers)
    return cmd_presets()


def cmd_scale(run_dir: str, rollout_workers: int) -> int:
    """``spmdcall-rl scale RUN_DIR --rollout-workers N``: ask a running asynchronous run for N rollout
    processes; it takes the request at its next step (and says so in its output)."""
    import yaml

    from rl_extension.trainers.async_rollout import ScaleRequests

    saved = Path(run_dir) / "config.yaml"
    if not saved.exists():
        print(f"spmdcall-rl scale: {run_dir} is not a run directory (no config.yaml)", file=sys.stderr)
        return 2
    trainer = (yaml.safe_load(saved.read_text()) or {}).get("trainer", {})
    if trainer.get("mode") != "async":
        print(f"spmdcall-rl scale: {run_dir} is not a trainer.mode=async run", file=sys.stderr)
        return 2
    start = trainer.get("rollout_workers") or trainer.get("num_workers", 1)
    low, high = trainer.get("rollout_workers_min", 1), trainer.get("rollout_workers_max") or start
    if not low <= rollout_workers <= high:
        print(
            f"spmdcall-rl scale: --rollout-workers {rollout_workers} is outside the run's "
            f"trainer.rollout_workers_min={low} .. trainer.rollout_workers_max={high}",
            file=sys.stderr,
        )
        return 2
    ScaleRequests(Path(run_dir)).ask(rollout_workers)
    print(f"asked {run_dir} for {rollout_workers} rollout workers: the run takes it at its next step")
    return 0


def _parser() -> argparse.ArgumentParser:
    """The argument table of every command."""
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
    p.add_argument("--backend", default="process", help="process (default), ray or monarch")
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
    p = sub.add_parser("scale", help="ask a running async run for more or fewer rollout workers")
    p.add_argument("run_dir")
    p.add_argument("--rollout-workers", type=int, required=True, help="the number of rollout processes")
    return parser


def cmd_demo(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``spmdcall-rl demo``: ``run_demo`` with the command's options; Ctrl-C says how to go on."""
    sft_items = [i.removeprefix("sft.") for i in args.items if i.startswith("sft.")]
    train_items = [i for i in args.items if not i.startswith("sft.")]
    for items in (train_items, sft_items):
        _split_preset(items)  # an item that is not key=value exits here, before torch loads
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


def cmd_presets() -> int:
    """``spmdcall-rl presets``: each shipped preset with the first sentence of its header comment."""
    from rl_extension.config import PRESET_DIR, preset_names

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
