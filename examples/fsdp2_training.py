"""FSDP2 data-parallel training of a tiny Hugging Face causal LM, driven from one controller.

What it shows:

- each worker joins torch.distributed with ``sc.init_distributed()`` (gloo on CPU, nccl on GPUs),
  builds the same random Qwen2 model from a seed, shards every decoder layer and then the root
  with FSDP2's ``fully_shard``, and builds an AdamW optimizer over the sharded parameters;
- ``train_step`` is a ``DP_COMPUTE_METRIC`` call: the controller passes one batch, each rank trains
  on its slice, FSDP2 averages the gradients, and the loss comes back averaged over the ranks;
- ``full_state_dict`` gathers the unsharded weights to CPU on rank 0. Every rank must take part
  in the gather, so it runs on all ranks (``ONE_TO_ALL``) and only rank 0 returns the weights;
- the controller loads those weights into a fresh model of its own and checks that its logits
  equal the logits the workers compute with the sharded model (``logits``, ``DP_COMPUTE_PROTO``).

The task is counting: every row is ``s, s+1, s+2, ...`` modulo the vocabulary, so the next token
is always the current one plus one and the loss falls within a few steps.

The ranks run collectives together, so this needs a backend with one process per rank
(``process`` or ``ray``); the inline backend calls ranks one after another and would deadlock.

Needs torch and transformers: ``pip install "spmdcall[rl]"`` (``[torch]`` has no transformers).

Run it:

    python examples/fsdp2_training.py [--backend process|ray] [--steps N]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM

import spmdcall as sc
from spmdcall.data import DataProto

WORLD_SIZE = 2
VOCAB_SIZE = 128
SEQ_LEN = 16
# The loss must end below this fraction of where it started, or the example fails.
MAX_LOSS_RATIO = 0.7
LOGITS_ATOL = 1e-5


def tiny_config() -> Qwen2Config:
    """A ~100k-parameter Qwen2: small enough to train on two CPU processes in seconds."""
    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
    )


class FSDPTrainer(sc.Worker):
    """One data-parallel rank: a shard of the model and of its optimizer state."""

    def __init__(self, seed: int, lr: float):
        # Both ranks share a small CPU; more threads per rank only make them fight over the cores.
        torch.set_num_threads(1)
        sc.init_distributed()
        mesh = sc.build_device_mesh((self.world_size,), ("dp",))

        # The same seed on every rank gives every rank the same initial weights; fully_shard then
        # keeps only this rank's shard of each parameter.
        torch.manual_seed(seed)
        self.model = Qwen2ForCausalLM(tiny_config())
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)  # one all-gather per layer, freed again after use
        fully_shard(self.model, mesh=mesh)  # the root holds what is left: embeddings, norm, head
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_METRIC)
    def train_step(self, batch: DataProto) -> dict:
        """One optimizer step on this rank's rows; returns the loss averaged over all ranks."""
        self.model.train()
        input_ids = batch.batch["input_ids"]
        loss = self.model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()  # FSDP2 reduce-scatters the gradients: each rank keeps its shard, averaged
        self.optimizer.step()
        self.optimizer.zero_grad()

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # gloo has no AVG: sum, then divide
        return {"loss": mean_loss.item() / self.world_size, "num_rows": len(batch)}

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def logits(self, batch: DataProto) -> DataProto:
        """The sharded model's logits for this rank's rows."""
        self.model.eval()
        out = self.model(input_ids=batch.batch["input_ids"])
        return DataProto.from_dict({"logits": out.logits})

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The unsharded weights, on CPU, from rank 0 (None from the other ranks)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(self.model, options=options)  # a collective: every rank calls it
        return state_dict if self.rank == 0 else None

    def close(self) -> None:
        dist.destroy_process_group()


def counting_batch(num_rows: int, generator: torch.Generator) -> DataProto:
    """Rows of consecutive tokens from a random start, wrapping around the vocabulary."""
    starts = torch.randint(0, VOCAB_SIZE, (num_rows, 1), generator=generator)
    return DataProto.from_dict({"input_ids": (starts + torch.arange(SEQ_LEN)) % VOCAB_SIZE})


def main(argv: list[str] | None = None) -> dict:
    """Train, gather the weights and compare logits. Returns the losses and the largest logit gap."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="process", help="process (default) or ray")
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps (default 25)")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per step, split over the ranks")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.backend == "inline":
        parser.error(
            "FSDP2 needs every rank running at once; the inline backend runs ranks one after "
            "another in this process. Use --backend process (or ray)."
        )
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 to see the loss fall, got {args.steps}")

    generator = torch.Generator().manual_seed(args.seed)
    pool = sc.ResourcePool([WORLD_SIZE])
    trainer = sc.ClassWithInitArgs(FSDPTrainer, seed=args.seed, lr=args.lr)
    start = time.monotonic()
    with sc.WorkerGroup(pool, trainer, backend=args.backend, default_timeout=120) as wg:
        print(f"{WORLD_SIZE} FSDP2 ranks ready in {time.monotonic() - start:.1f} s")

        # 1. Train: every call splits the batch over the ranks; metrics come back one dict per rank.
        losses = []
        for step in range(1, args.steps + 1):
            metrics = wg.train_step(counting_batch(args.batch_size, generator))
            losses.append(metrics[0]["loss"])  # the same on every rank: it was all-reduced
            if step == 1 or step % 5 == 0 or step == args.steps:
                rows = [m["num_rows"] for m in metrics]
                print(f"step {step:3d}  loss {losses[-1]:.4f}  rows per rank {rows}")
        print(
            f"trained {args.steps} steps in {time.monotonic() - start:.1f} s: "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        )

        # 2. The workers' logits on held-out rows (an odd count: the split pads, the collect unpads).
        probe = counting_batch(5, generator)
        worker_logits = wg.logits(probe).batch["logits"]

        # 3. Gather the full weights (rank 0 returns them) and load them into a model of our own.
        state_dict = wg.full_state_dict()[0]
        wg.close()

    model = Qwen2ForCausalLM(tiny_config())
    model.load_state_dict(state_dict)
    model.eval()
    with torch.no_grad():
        local_logits = model(input_ids=probe.batch["input_ids"]).logits
    max_diff = (local_logits - worker_logits).abs().max().item()
    num_params = sum(t.numel() for t in state_dict.values())
    print(f"full state dict: {len(state_dict)} tensors, {num_params} parameters")
    print(
        f"logits of the gathered model vs the sharded one: max |diff| = {max_diff:.2e} "
        f"over {tuple(local_logits.shape)}"
    )

    failures = []
    if not losses[-1] < MAX_LOSS_RATIO * losses[0]:
        failures.append(
            f"the loss did not fall enough: {losses[0]:.4f} -> {losses[-1]:.4f} "
            f"(expected below {MAX_LOSS_RATIO} x the first)"
        )
    if not torch.allclose(local_logits, worker_logits, atol=LOGITS_ATOL):
        failures.append(f"logits differ by up to {max_diff:.2e} (atol {LOGITS_ATOL})")
    if failures:
        sys.exit("fsdp2_training: FAILED\n  " + "\n  ".join(failures))
    print(f"fsdp2_training: OK ({time.monotonic() - start:.1f} s)")
    return {"losses": losses, "max_logit_diff": max_diff, "num_tensors": len(state_dict)}


if __name__ == "__main__":
    main()
