"""One training run of one engine (ours or TRL) for ``compare_trl.py``, in a process of its own.

    python benchmarks/rl/engines.py SPEC.json      # compare_trl.py writes the spec and starts this

The run reads a ``RunSpec`` (JSON), trains, and writes what it measured to ``spec.result_file``:
each step's seconds (``step_s``: the step alone; ``loop_s``: from the end of the previous step,
logging included, validation excluded; ``cpu_s``: CPU seconds of the engine's processes over the
same span) and each held-out validation (step, accuracy, seconds).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # rl_extension from this checkout, installed or not

from rl_extension.trainers.ppo import PPOTrainer  # noqa: E402


@dataclass(frozen=True)
class TaskSpec:
    """What a task needs beyond its rows: its generator's arguments, lengths, and its scorer."""

    task_kwargs: dict
    """Arguments of the row generator in ``rl_extension.data.prompts.TASKS``."""
    max_prompt_length: int
    """Longest prompt in tokens."""
    max_new_tokens: int
    """Response length limit: the answer and its eos fit."""
    scorer: str
    """Scorer of the reward (``rl_extension.data.rewards.get_scorer``); accuracy counts scores of 1.0."""


# addition is the demo's task (answers of at most 4 tokens); sorting is the longer one (35 tokens).
TASKS = {
    "addition": TaskSpec(
        task_kwargs={"num_digits": 3}, max_prompt_length=16, max_new_tokens=6, scorer="exact_match"
    ),
    "sorting": TaskSpec(
        task_kwargs={"num_items": 12}, max_prompt_length=48, max_new_tokens=40, scorer="sorting"
    ),
}

# bf16 mixed precision, the same for both engines: float32 weights and optimizer, bfloat16 matmuls
# (AMX on recent x86 CPUs), eager attention (the CPU sdpa backward is slow in bfloat16). Ours runs
# FSDP2's MixedPrecisionPolicy and a bfloat16 rollout copy; TRL runs its `bf16=True` (autocast).
PRECISION: dict[str, dict[str, Any]] = {
    # Explicit, so that a preset with model.compute_dtype=auto cannot turn it into bfloat16.
    "fp32": {
        "ours": ["model.compute_dtype=float32", "model.attn_implementation=sdpa"],
        "trl_bf16": False,
        "attn_implementation": "sdpa",
    },
    "bf16": {
        "ours": ["model.compute_dtype=bfloat16", "model.attn_implementation=eager"],
        "trl_bf16": True,
        "attn_implementation": "eager",
    },
}

# The demo preset's cosine decay ends at this share of the learning rate; both engines decay alike.
MIN_LR_RATIO = 0.1
# TRL's arguments for each --lr-schedule: transformers' cosine_with_min_lr is the curve of ours'
# rl_extension.fsdp.build_scheduler (no warmup): min + (1 - min) * (1 + cos(pi * step / steps)) / 2.
TRL_LR_SCHEDULES: dict[str, dict[str, Any]] = {
    "constant": {"lr_scheduler_type": "constant"},
    "cosine": {
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": MIN_LR_RATIO},
    },
}

# TRL's arguments for each rollout engine name (ours takes the name as rollout.name).
TRL_ROLLOUT_ARGS: dict[str, dict[str, Any]] = {
    "hf": {},
    "vllm": {"use_vllm": True, "vllm_mode": "colocate"},
}


@dataclass(kw_only=True)
class RunSpec:
    """Everything one engine's run needs."""

    engine: str
    """ours or trl."""
    mode: str
    """speed (num_steps steps, no validation) or learn (validate, stop at the target or the time cap)."""
    model: str
    """The warm-start Hugging Face checkpoint (its tokenizer too)."""
    train_file: str
    test_file: str
    task: str
    """A key of TASKS."""
    rollout: str
    """A key of TRL_ROLLOUT_ARGS; ours takes it as rollout.name."""
    run_dir: str
    result_file: str
    num_steps: int
    val_every: int
    target_points: float
    """learn: stop once the held-out accuracy is this many points above its start."""
    max_minutes: float
    """learn: stop after this much wall time."""
    lr: float
    num_prompts: int
    num_generations: int
    num_workers: int
    """ours: worker processes."""
    num_threads: int
    """Torch threads in all: TRL's process has them all, each of our workers its share."""
    seed: int
    precision: str = "fp32"
    """fp32, or bf16: mixed precision for both engines (see PRECISION)."""
    lr_schedule: str = "constant"
    """constant, or cosine: decay to MIN_LR_RATIO x lr over num_steps, the same curve for both engines."""
    ours_overrides: list[str] = field(default_factory=list)
    """Extra ``key=value`` overrides of our PPOConfig."""


class StopRun(Exception):
    """Raised between two steps to end a run: the target accuracy is reached or the time is up."""


class StepLog:
    """Per-step timings and validations of one run, and the decision to stop it."""

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.start = time.perf_counter()
        self.steps: list[dict[str, float]] = []
        self.validations: list[dict[str, float]] = []
        self.stop_reason = "steps done"

    def validation(self, step: int, accuracy: float, seconds: float) -> None:
        self.validations.append({"step": step, "accuracy": accuracy, "seconds": seconds})

    def step(self, record: dict[str, float]) -> None:
        """Record a finished step (after its validation, if any); raise StopRun if the run ends here."""
        self.steps.append(record)
        if self.spec.mode != "learn":
            return
        first, last = self.validations[0], self.validations[-1]
        if (
            last["step"] == record["step"]
            and last["accuracy"] >= first["accuracy"] + self.spec.target_points / 100
        ):
            self.stop_reason = "target reached"
            raise StopRun
        if time.perf_counter() - self.start > 60 * self.spec.max_minutes:
            self.stop_reason = f"{self.spec.max_minutes:g} min cap"
            raise StopRun

    def result(self, startup_s: float, **extra: Any) -> dict[str, Any]:
        return {
            "spec": asdict(self.spec),
            "startup_s": startup_s,
            "steps": self.steps,
            "validations": self.validations,
            "stop_reason": self.stop_reason,
            **extra,
        }


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its children so far: an engine's work, which load
    on the machine stretches much less than its wall time."""
    return sum(cpu_by_process().values())


def cpu_by_process() -> dict[int, float]:
    """CPU seconds so far of this process and of each of its children, by pid."""
    import psutil

    out = {}
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[proc.pid] = times.user + times.system
    return out


# -- ours ------------------------------------------------------------------------------------------


def run_ours(spec: RunSpec) -> dict[str, Any]:
    """PPOTrainer on the tiny-cpu preset with the spec's model, data, batch and learning rate."""
    from rl_extension.config import PPOConfig, load_config

    task, learn = TASKS[spec.task], spec.mode == "learn"
    config = load_config(
        PPOConfig,
        "tiny-cpu",
        [
            f"model.path={spec.model}",
            f"data.train_files=[{spec.train_file}]",
            f"data.val_files=[{spec.test_file}]",
            f"data.max_prompt_length={task.max_prompt_length}",
            f"data.train_batch_size={spec.num_prompts}",
            f"actor.ppo_mini_batch_size={spec.num_prompts}",
            f"actor.lr={spec.lr}",
            # The spec's schedule over the spec's steps, as TRL's (not the preset's over its own steps).
            f"actor.lr_schedule={spec.lr_schedule}",
            f"actor.min_lr_ratio={MIN_LR_RATIO}",
            # TRL's GRPOTrainer has neither: the preset's guidance and supervised term stay off, so
            # both engines run the same algorithm (--engines 'ours@KEY=VALUE' turns them on).
            "algorithm.guide_failed_groups=false",
            "actor.sft_loss_coef=0",
            f"rollout.name={spec.rollout}",
            f"rollout.n={spec.num_generations}",
            f"rollout.max_new_tokens={task.max_new_tokens}",
            f"reward.scorer={task.scorer}",
            "trainer.backend=process",
            f"trainer.num_workers={spec.num_workers}",
            f"trainer.threads_per_worker={max(1, spec.num_threads // spec.num_workers)}",
            f"trainer.seed={spec.seed}",
            f"trainer.total_steps={spec.num_steps}",
            f"trainer.val_every={spec.val_every if learn else 0}",
            f"trainer.val_before_train={str(learn).lower()}",
            f"trainer.run_dir={spec.run_dir}",
            "trainer.overwrite=true",
            "trainer.save_every=0",
            "trainer.max_checkpoints=1",
            "trainer.save_hf_model=false",  # saved below, also when the run stops early
            "trainer.loggers=[jsonl]",
            "trainer.progress=none",
            *PRECISION[spec.precision]["ours"],
            *spec.ours_overrides,
        ],
    )
    log = StepLog(spec)
    start = time.perf_counter()
    trainer = WatchedTrainer(config, log)
    startup_s = time.perf_counter() - start
    with trainer:
        try:
            trainer.fit()
        except StopRun:
            pass
        if learn:  # the final model, as TRL's (score_models.py scores both on many more problems)
            trainer.roles.actor.save_hf_model(str(Path(spec.run_dir) / "hf_model"), trainer.tokenizer_path)
    return log.result(startup_s)


class WatchedTrainer(PPOTrainer):
    """PPOTrainer whose tracker also reports each step to a StepLog, which may stop the run there."""

    def __init__(self, config: Any, log: StepLog):
        self.log = log
        self.last_log_t = 0.0
        self.call_cpu: dict[str, float] = {}
        super().__init__(config)
        r = self.roles
        self.roles = replace(
            r,
            actor=MeteredGroup(r.actor, "actor", self.call_cpu),
            rollout=MeteredGroup(r.rollout, "rollout", self.call_cpu),
        )

    def _make_tracker(self) -> Any:  # fit() calls it once, just before its loop
        self.last_log_t, self.last_cpu = time.perf_counter(), cpu_seconds()
        return _ForwardingTracker(super()._make_tracker(), self._on_log)

    def _on_log(self, metrics: dict[str, float], step: int) -> None:
        now, cpu = time.perf_counter(), cpu_seconds()
        validate_s = metrics.get("timing/validate_s", 0.0)
        if "val/accuracy" in metrics:
            self.log.validation(step, metrics["val/accuracy"], validate_s)
        if step == 0:  # the validation before training
            self.last_log_t, self.last_cpu = now, cpu
            return
        loop_s = now - self.last_log_t - validate_s - metrics.get("timing/save_s", 0.0)
        cpu_s = cpu - self.last_cpu  # validation and checkpoint included: use it in speed mode
        self.last_log_t, self.last_cpu = now, cpu
        skip = ("timing/step_s", "timing/validate_s", "timing/save_s")
        stages = {k: v for k, v in metrics.items() if k.startswith("timing/") and k not in skip}
        record = {
            "step": step,
            "step_s": metrics["timing/step_s"],
            "loop_s": loop_s,
            "cpu_s": cpu_s,
            "gen_tokens_per_s": metrics["perf/gen_tokens_per_s"],
            "response_length": metrics["response/length_mean"],
        }
        stages |= {f"cpu/{k}": v for k, v in self.call_cpu.items()}
        self.call_cpu.clear()
        self.log.step(record | stages)


class MeteredGroup:
    """A worker group (or view) whose calls also add up the CPU seconds they cost, in ``sink``:
    ``<name>.<method>_workers_s`` (all workers) and ``<name>.<method>_controller_s`` (this process)."""

    def __init__(self, group: Any, name: str, sink: dict[str, float]):
        self.group, self.name, self.sink = group, name, sink

    def __getattr__(self, method: str) -> Any:
        attr = getattr(self.group, method)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            before = cpu_by_process()
            try:
                return attr(*args, **kwargs)
            finally:
                after, me = cpu_by_process(), os.getpid()
                spent = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
                key = f"{self.name}.{method}"
                self.sink[f"{key}_controller_s"] = self.sink.get(f"{key}_controller_s", 0.0) + spent.pop(
                    me, 0.0
                )
                self.sink[f"{key}_workers_s"] = self.sink.get(f"{key}_workers_s", 0.0) + sum(spent.values())

        return call


class _ForwardingTracker:
    """The trainer's Tracker, with a hook after each log (which may raise StopRun between steps)."""

    def __init__(self, tracker: Any, on_log: Any):
        self.tracker, self.on_log = tracker, on_log

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.tracker.log(metrics, step)
        self.on_log(metrics, step)

    def print(self, text: str) -> None:
        self.tracker.print(text)

    def close(self) -> None:
        self.tracker.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tracker, name)  # the rest of the Tracker (sync before a checkpoint, ...)


# -- TRL -------------------------------------------------------------------------------------------


def run_trl(spec: RunSpec) -> dict[str, Any]:
    """trl.GRPOTrainer with the same model, tokenizer, prompts, reward, batch and learning rate."""
    import torch

    torch.set_num_threads(spec.num_threads)
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    from rl_extension.data.rewards import get_scorer
    from rl_extension.models import load_tokenizer

    task, learn = TASKS[spec.task], spec.mode == "learn"
    start = time.perf_counter()
    tokenizer = load_tokenizer(spec.model)
    precision = PRECISION[spec.precision]
    model = AutoModelForCausalLM.from_pretrained(
        spec.model, dtype=torch.float32, attn_implementation=precision["attn_implementation"]
    )
    scorer = get_scorer(task.scorer)

    def task_reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [float(scorer(c, a)) for c, a in zip(completions, answer)]

    args = trl.GRPOConfig(
        output_dir=spec.run_dir,
        use_cpu=True,
        seed=spec.seed,
        max_steps=spec.num_steps,
        # One generation batch of num_prompts x num_generations rows, one optimizer step on it: on-policy.
        per_device_train_batch_size=spec.num_prompts * spec.num_generations,
        gradient_accumulation_steps=1,
        num_generations=spec.num_generations,
        num_iterations=1,
        max_completion_length=task.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=spec.lr,
        **TRL_LR_SCHEDULES[spec.lr_schedule],
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",  # token-mean over the batch, as ours
        scale_rewards="group",
        bf16=precision["trl_bf16"],
        gradient_checkpointing=False,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
        **TRL_ROLLOUT_ARGS[spec.rollout],
    )
    log = StepLog(spec)
    evaluate = held_out_evaluator(spec, tokenizer)

    class Watch(TrainerCallback):
        """Times each step, validates every val_every steps (learn mode), stops the run like ours."""

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            if learn:
                log.validation(0, *evaluate(model))
            self.last_end, self.last_cpu = time.perf_counter(), cpu_seconds()

        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self.begin = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            end, cpu = time.perf_counter(), cpu_seconds()
            record = {
                "step": state.global_step,
                "step_s": end - self.begin,
                "loop_s": end - self.last_end,
                "cpu_s": cpu - self.last_cpu,
            }
            if learn and state.global_step % spec.val_every == 0:
                log.validation(state.global_step, *evaluate(model))
            # The next loop_s and cpu_s start after this validation.
            self.last_end, self.last_cpu = time.perf_counter(), cpu_seconds()
            try:
                log.step(record)
            except StopRun:
                control.should_training_stop = True

    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=task_reward,
        args=args,
        train_dataset=Dataset.from_parquet(spec.train_file),
        processing_class=tokenizer,
        callbacks=[Watch()],
    )
    startup_s = time.perf_counter() - start
    trainer.train()
    if learn:  # the final model, as ours' (score_models.py scores both on many more problems)
        trainer.save_model(str(Path(spec.run_dir) / "hf_model"))
    return log.result(startup_s, trl_version=trl.__version__)


def held_out_evaluator(spec: RunSpec, tokenizer: Any) -> Any:
    """``evaluate(model) -> (accuracy, seconds)``: greedy on the test split, as our trainer validates."""
    score = greedy_scorer(spec.test_file, spec.task, tokenizer)

    def evaluate(model: Any) -> tuple[float, float]:
        start = time.perf_counter()
        return score(model).mean().item(), time.perf_counter() - start

    return evaluate


def greedy_scorer(test_file: str, task_name: str, tokenizer: Any) -> Any:
    """``score(model) -> (rows,) tensor``: 1.0 where the model's greedy answer to a row of ``test_file``
    is right, as our trainer validates (``generate_responses`` + ``RewardManager``, exact match)."""
    from rl_extension.data.prompts import PromptDataset, PromptLoader
    from rl_extension.data.rewards import RewardManager
    from rl_extension.roles.rollout import generate_responses

    task = TASKS[task_name]
    dataset = PromptDataset(test_file, tokenizer, max_prompt_length=task.max_prompt_length)
    batch = next(iter(PromptLoader(dataset, len(dataset), shuffle=False, drop_last=False)))
    manager = RewardManager(tokenizer, task.scorer)

    def score(model: Any) -> Any:
        was_training = model.training
        model.eval()
        eos = model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        out = generate_responses(
            model,
            batch,
            max_new_tokens=task.max_new_tokens,
            eos_token_ids=sorted(set(eos) | {tokenizer.eos_token_id}),
            pad_token_id=tokenizer.pad_token_id,
            do_sample=False,
        )
        model.train(was_training)
        return manager(out).accuracy

    return score


def main(spec_file: str) -> int:
    spec = RunSpec(**json.loads(Path(spec_file).read_text()))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    result = (run_ours if spec.engine == "ours" else run_trl)(spec)
    Path(spec.result_file).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
