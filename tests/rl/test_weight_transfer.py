"""Weights from an actor group to a rollout group of its own, through the SDK (#47, asynchronous mode).

``Actor.export_weights`` gathers the FSDP2 shards and returns one state dict (rank 0's);
``HFRollout.load_weights(weights, version)`` copies it into every rollout rank in place. The
controller passes the export's future straight into the load. The vLLM rollout's ``load_weights``
is tested in test_vllm.py.

Run: python -m pytest tests/rl/test_weight_transfer.py -q
"""

from __future__ import annotations

import pytest
import torch
from batches import prompt_batch

import spmdcall as sc
from rl_extension.config import ActorConfig, ModelConfig, RolloutConfig
from rl_extension.models import build_tiny_model, load_causal_lm, load_tokenizer
from rl_extension.roles import Actor, HFRollout
from rl_extension.roles.keys import ACTOR_UPDATE_KEYS

TEXTS = ["12+34=", "7+5=", "903+88=", "1+1="]


class ProbedActor(Actor):
    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights as torch.distributed.checkpoint gathers them (a second opinion)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))


class ProbedRollout(HFRollout):
    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """This rank's policy version and parameters (tied ones once)."""
        return self.policy_version, {n: p.detach().clone() for n, p in self.model.named_parameters()}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    # The smallest model that still has every kind of weight (tied embedding included).
    path = tmp_path_factory.mktemp("transfer") / "tiny"
    return build_tiny_model(path, num_layers=1, hidden_size=32, num_heads=1, intermediate_size=64)


def groups(tiny_path: str, backend: str, num_workers: int) -> tuple[sc.WorkerGroup, sc.WorkerGroup]:
    model = ModelConfig(path=tiny_path)
    actor = sc.ClassWithInitArgs(
        ProbedActor,
        model,
        ActorConfig(lr=1e-2, ppo_mini_batch_size=1),
        model_path=tiny_path,
        num_mini_batches=1,
        total_steps=10,
        threads=1,
    )
    rollout = sc.ClassWithInitArgs(
        ProbedRollout,
        model,
        RolloutConfig(n=2, max_new_tokens=4),
        model_path=tiny_path,
        tokenizer_path=tiny_path,
        threads=1,
    )
    pool = sc.ResourcePool([num_workers])
    actor_group = sc.WorkerGroup(pool, actor, backend=backend, name=f"transfer_actor_{backend}")
    try:
        rollout_group = sc.WorkerGroup(
            sc.ResourcePool([num_workers]), rollout, backend=backend, name=f"transfer_rollout_{backend}"
        )
    except BaseException:
        actor_group.shutdown()
        raise
    return actor_group, rollout_group


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend, num_workers", [("inline", 1), ("process", 2)])
def test_rollout_group_takes_the_actor_groups_weights_after_an_update(tiny_path, backend, num_workers):
    actor, rollout = groups(tiny_path, backend, num_workers)
    try:
        start = actor.export_weights()
        sampled = rollout.generate(prompt_batch(load_tokenizer(tiny_path), TEXTS))
        advantages = torch.randn(sampled.batch["responses"].shape, generator=torch.Generator().manual_seed(0))
        sampled.batch["advantages"] = advantages * sampled.batch["response_mask"]
        actor.update_policy(sampled.select(batch_keys=ACTOR_UPDATE_KEYS))

        rollout.load_weights(actor.export_weights.submit(), version=1)  # a future from the other group
        exported, reference = actor.export_weights(), actor.full_state_dict()[0]
        for version, weights in rollout.weights():
            assert version == 1
            assert weights.keys() == exported.keys()
            for name, tensor in exported.items():
                assert torch.equal(weights[name], tensor), name
                assert torch.equal(reference[name], tensor), name
        checkpoint = load_causal_lm(tiny_path).state_dict()
        assert "lm_head.weight" in checkpoint and "lm_head.weight" not in exported  # tied: once
        assert exported.keys() == checkpoint.keys() - {"lm_head.weight"}  # HF checkpoint names
        assert any(not torch.equal(start[n], exported[n]) for n in exported), "the update changed nothing"

        # A name mismatch names what is missing, and loads nothing.
        wrong = dict(start)
        wrong["model.embed.weight"] = wrong.pop("model.embed_tokens.weight")
        with pytest.raises(
            sc.WorkerError,
            match=r"missing \['model.embed_tokens.weight'\], not in the model \['model.embed.weight'\]",
        ):
            rollout.load_weights(wrong, version=2)
        assert all(
            version == 1 and torch.equal(w[n], exported[n]) for version, w in rollout.weights() for n in w
        )
        with pytest.raises(sc.WorkerError, match="version must be an int"):
            rollout.load_weights(start, version="2")
    finally:
        actor.shutdown()
        rollout.shutdown()
