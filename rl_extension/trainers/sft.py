"""Supervised fine-tuning with FSDP2 on a worker group: the warm start before RL.

Each example is ``prompt -> answer + eos``; the loss covers the answer tokens (and the eos) only,
so the model learns to answer and to stop, not to write prompts. The result is a Hugging Face
checkpoint that ``spmdcall-rl train model.path=...`` starts from.

    spmdcall-rl sft preset=sft-tiny-cpu                   # -> runs/sft-tiny-cpu/hf_model
    python -m rl_extension sft preset=sft-tiny-cpu total_steps=200

    summary = SFTTrainer(load_config(SFTConfig, "sft-tiny-cpu")).fit()
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

import spmdcall as sc
from rl_extension import fsdp
from rl_extension.agents import (
    TURNS_DISPATCH,
    AgentRollout,
    TurnOutput,
    TurnRequest,
    decode_turns,
    format_for,
)
from rl_extension.agents.calc import tokenize_demonstration
from rl_extension.config import RolloutConfig, SFTConfig, save_config, to_dict
from rl_extension.data.inputs import check_inputs
from rl_extension.data.prompts import PromptDataset, datasets_from_config
from rl_extension.data.rewards import RewardManager
from rl_extension.models import load_tokenizer, resolve_model_path
from rl_extension.roles.rollout import generate_responses
from rl_extension.trainers.metrics import Tracker, mean_metrics, truncate_jsonl
from rl_extension.trainers.run_dir import run_with_restarts
from spmdcall.data import DataProto

__all__ = ["SFTTrainer", "SFTWorker"]


class SFTWorker(sc.Worker):
    """One data-parallel rank of SFT: a shard of the model and of the optimizer state.

    Args:
        config: model, optimizer and schedule settings.
        model_path: the checkpoint to fine-tune.
        eos_token_ids: tokens that end a generated answer (evaluation).
        pad_token_id: padding of generated answers.
    """

    def __init__(self, config: SFTConfig, *, model_path: str, eos_token_ids: list[int], pad_token_id: int):
        self.config = config
        self.eos_token_ids, self.pad_token_id = eos_token_ids, pad_token_id
        self.device = fsdp.setup_worker(config.threads_per_worker, config.use_gpu)
        torch.manual_seed(config.seed)
        self.model, self.optimizer, self.scheduler = fsdp.build_training(
            config.model,
            model_path,
            config,
            self.device,
            total_steps=config.total_steps,
            fsdp_size=config.fsdp_size,
        )

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_METRIC)
    def train_step(self, batch: DataProto) -> dict[str, float]:
        """One optimizer step on this rank's examples (``input_ids``, ``attention_mask``, ``loss_mask``)."""
        self.model.train()
        data = batch.to(self.device)
        total_tokens = data.batch["loss_mask"][:, 1:].sum().clamp(min=1)
        loss_sum = 0.0
        for micro in data.split(self.config.micro_batch_size_per_worker or len(data)):
            ids, mask = micro.batch["input_ids"], micro.batch["loss_mask"][:, 1:].float()
            logits = self.model(
                input_ids=ids, attention_mask=micro.batch["attention_mask"], use_cache=False
            ).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(
                logits.float().transpose(1, 2), ids[:, 1:], reduction="none"
            )
            loss = (nll * mask).sum() / total_tokens  # every answer token of this rank weighs the same
            loss.backward()
            loss_sum += loss.item()
        grad_norm = fsdp.clip_grad_norm(self.model, self.config.grad_clip)
        if np.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return {"sft/loss": loss_sum, "sft/grad_norm": grad_norm, "sft/lr": lr}

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def generate(self, prompts: DataProto) -> DataProto:
        """Greedy answers to left-padded prompts (for the held-out accuracy)."""
        self.model.eval()
        return generate_responses(
            self.model,
            prompts,
            max_new_tokens=self.config.max_new_tokens,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            do_sample=False,
        )

    @sc.register(dispatch_mode=TURNS_DISPATCH)
    def generate_turns(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        """One greedy turn per request, for the agent loop's evaluation (multi_turn)."""
        self.model.eval()
        return decode_turns(
            self.model, requests, stop_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id
        )

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def save_hf_model(self, path: str, tokenizer_path: str) -> None:
        """Write the model as a Hugging Face checkpoint (rank 0 writes)."""
        fsdp.save_hf_model(self.model, path, tokenizer_path)


class SFTTrainer:
    """The controller of an SFT run: data, the worker group, the loop, evaluation, the HF export.

    Args:
        config: the run's SFTConfig.

    Example:
        >>> summary = SFTTrainer(load_config(SFTConfig, "sft-tiny-cpu", ["total_steps=100"])).fit()  # doctest: +SKIP
        >>> summary["hf_model"], summary["val/accuracy"]
    """

    def __init__(self, config: SFTConfig):
        config.validate()
        check_inputs(config)  # a missing checkpoint or data file fails here, before output_dir is touched
        self.config = config
        self.output_dir = Path(config.output_dir).resolve()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, self.output_dir / "config.yaml")
        self.model_path = resolve_model_path(config.model, self.output_dir)
        self.tokenizer_path = config.model.tokenizer_path or self.model_path
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        self.train_set, self.answers, self.val_batches = self._build_data()
        self.reward_manager = RewardManager(self.tokenizer, config.eval_scorer or None)
        self.agent: AgentRollout | None = None
        eos = [self.tokenizer.eos_token_id]
        worker = sc.ClassWithInitArgs(
            SFTWorker,
            config,
            model_path=self.model_path,
            eos_token_ids=eos,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        self.group = sc.WorkerGroup(
            sc.ResourcePool([config.num_workers], use_gpu=config.use_gpu),
            worker,
            backend=config.backend,
            name="sft",
            default_timeout=config.call_timeout_s,
        )
        if config.multi_turn.enable:  # evaluate with the agent loop and the tools, greedy
            rollout = RolloutConfig(max_new_tokens=config.max_new_tokens, multi_turn=config.multi_turn)
            self.agent = AgentRollout(self.group, self.tokenizer, rollout, max_in_flight=1, seed=config.seed)

    def fit(self) -> dict[str, float | str]:
        """Train ``total_steps`` steps, evaluate, save ``output_dir/hf_model``; returns the last metrics.

        With ``max_restarts``, a dead rank or a call past ``call_timeout_s`` restarts the group (its
        ranks build the model from ``model.path`` again) and the run trains again from step 0 in
        this process: SFT keeps no checkpoints, and a run with the same seed repeats its steps, so
        metrics.jsonl ends with every step once, as without the fault.
        """
        return run_with_restarts(self._fit_once, self._recover, self.config.max_restarts, where=lambda: "SFT")

    def _recover(self, restarts: int) -> None:
        """Restart every rank (each builds the model from ``model.path`` again), empty metrics.jsonl."""
        print(f"restart {restarts} of {self.config.max_restarts}: restarting the group, then from step 0")
        self.group.restart(list(range(self.group.world_size)))
        truncate_jsonl(self.output_dir / "metrics.jsonl", -1)

    def _fit_once(self) -> dict[str, float | str]:
        cfg = self.config
        tracker = Tracker(
            self.output_dir,
            ["console", "jsonl"],
            experiment="sft",
            config=to_dict(cfg),
            total_steps=cfg.total_steps,
            progress="tqdm",
            log_every=cfg.log_every,
        )
        rng = np.random.default_rng(cfg.seed)
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        step = 0
        try:
            for step in range(1, cfg.total_steps + 1):
                rows = rng.integers(0, len(self.train_set), cfg.batch_size)
                metrics = mean_metrics(self.group.train_step(self._collate(rows)))
                out_of_time = bool(cfg.max_minutes) and time.perf_counter() - start >= 60 * cfg.max_minutes
                if self.val_batches and (
                    (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.total_steps or out_of_time
                ):
                    metrics |= self.evaluate()
                metrics["timing/elapsed_s"] = time.perf_counter() - start
                tracker.log(metrics, step)
                if out_of_time:
                    tracker.print(f"max_minutes={cfg.max_minutes:g} reached: stopping at step {step}")
                    break
                if cfg.stop_at_accuracy and metrics.get("val/accuracy", 0.0) >= cfg.stop_at_accuracy:
                    tracker.print(
                        f"validation accuracy (data.val_files) {metrics['val/accuracy']:.3f} >= stop_at_accuracy: stopping at step {step}"
                    )
                    break
            self.group.save_hf_model(str(self.output_dir / "hf_model"), self.tokenizer_path)
        finally:
            tracker.close()
        return {**metrics, "steps": step, "hf_model": str(self.output_dir / "hf_model")}

    def evaluate(self) -> dict[str, float]:
        """Greedy held-out accuracy (with the agent loop and its tools under multi_turn)."""
        generate = self.agent.generate if self.agent is not None else self.group.generate
        out = DataProto.concat([generate(replace(b, meta_info={"validate": True})) for b in self.val_batches])
        return self.reward_manager(out).metrics(prefix="val/")

    def _collate(self, rows: np.ndarray) -> DataProto:
        """Right-padded prompt + answer + eos; loss_mask marks the answer (less its tool results) and the eos."""
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        seqs, masks = [], []
        for i in rows:
            prompt = self.train_set[int(i)]["input_ids"]
            answer, trained = self.answers[int(i)]
            seqs.append(prompt + answer + [eos])
            masks.append([0] * len(prompt) + trained + [1])
        width = max(map(len, seqs))
        input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
        loss_mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, (seq, mask) in enumerate(zip(seqs, masks)):
            input_ids[r, : len(seq)] = torch.tensor(seq)
            attention_mask[r, : len(seq)] = 1
            loss_mask[r, : len(seq)] = torch.tensor(mask)
        return DataProto.from_dict(
            {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
        )

    def _build_data(self) -> tuple[PromptDataset, list[tuple[list[int], list[int]]], list[DataProto]]:
        train_set, val_batches = datasets_from_config(
            self.config.data, self.tokenizer, self.output_dir / "data"
        )
        texts = [train_set[i]["ground_truth"] for i in range(len(train_set))]
        if self.config.multi_turn.enable:  # demonstrations: the tool results are not the model's to learn
            fmt = format_for(self.tokenizer, self.config.multi_turn.format)
            return train_set, [tokenize_demonstration(self.tokenizer, t, fmt) for t in texts], val_batches
        answers = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return train_set, [(ids, [1] * len(ids)) for ids in answers], val_batches

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.close()
        self.group.shutdown()

    def __enter__(self) -> SFTTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
