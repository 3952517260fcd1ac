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


def groups(
    tiny_path: str, backend: str, num_workers: int, verify_weights: str = "auto", fsdp_size: int = -1
) -> tuple[sc.WorkerGroup, sc.WorkerGroup]:
    model = ModelConfig(path=tiny_path)
    actor = sc.ClassWithInitArgs(
        ProbedActor,
        model,
        ActorConfig(lr=1e-2, ppo_mini_batch_size=1, fsdp_size=fsdp_size),
        model_path=tiny_path,
        num_mini_batches=1,
        total_steps=10,
        threads=1,
    )
    rollout = sc.ClassWithInitArgs(
        ProbedRollout,
        model,
        RolloutConfig(n=2, max_new_tokens=4, verify_weights=verify_weights),
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


@pytest.mark.timeout(180)
def test_weights_published_into_a_store_reach_every_rollout_rank_as_deltas_and_checked(tiny_path, tmp_path):
    actor, rollout = groups(tiny_path, "process", 2)
    store = sc.WeightStore(parent=str(tmp_path))
    try:
        first = actor.publish_weights(1, store.root)
        assert isinstance(first, sc.WeightGeneration) and first.written == first.nbytes
        loads = rollout.load_weights(
            first, version=1
        )  # metadata through the controller, bytes from the store
        assert [m["sync/changed_fraction"] for m in loads] == [1.0, 1.0]
        assert all(m["sync/bytes"] == first.nbytes and m["sync/seconds"] > 0 for m in loads)

        unchanged = actor.publish_weights(2, store.root)  # no update since: nothing travels
        assert [m["sync/bytes"] for m in rollout.load_weights(unchanged, version=2)] == [0.0, 0.0]

        sampled = rollout.generate(prompt_batch(load_tokenizer(tiny_path), TEXTS))
        sampled.batch["advantages"] = (
            torch.ones(sampled.batch["responses"].shape) * sampled.batch["response_mask"]
        )
        actor.update_policy(sampled.select(batch_keys=ACTOR_UPDATE_KEYS))
        updated = actor.publish_weights.submit(3, store.root)  # a future works as well
        loads = rollout.load_weights(updated, version=3)
        assert all(0 < m["sync/changed_fraction"] <= 1 for m in loads)
        exported = actor.export_weights()
        for version, weights in rollout.weights():
            assert version == 3
            assert all(torch.equal(weights[n], exported[n]) for n in exported)

        # A tensor corrupted in shared memory after publishing: each rank names it, loads stop there.
        actor.update_policy(sampled.select(batch_keys=ACTOR_UPDATE_KEYS))
        corrupted = actor.publish_weights(4, store.root)
        entry = next(e for e in corrupted.entries if e.name == "model.layers.0.mlp.up_proj.weight")
        with open(f"{store.root}/slot-{corrupted.slot}-{entry.writer}.bin", "r+b") as f:
            f.seek(entry.offset + 8)
            f.write(b"\x00\x00\x80\x7f")  # an inf where a weight was
        with pytest.raises(sc.WorkerError, match=r"WeightChecksumError.*'model.layers.0.mlp.up_proj.weight'"):
            rollout.load_weights(corrupted, version=4)

        # Ranks restarted since take the newest generation themselves (both: they share a gloo group).
        repaired = actor.publish_weights(5, store.root)
        rollout.restart([0, 1])
        assert rollout.load_newest_weights(store.root) == [5, 5]
        exported = actor.export_weights()
        for version, weights in rollout.weights():
            assert version == 5 and all(torch.equal(weights[n], exported[n]) for n in exported)
        assert repaired.number == 5
    finally:
        actor.shutdown()
        rollout.shutdown()
        store.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(180)
def test_an_unchecked_corrupted_sync_is_caught_by_the_canary_naming_the_tensor(tiny_path, tmp_path):
    """With checksums off (rollout.verify_weights=never), the log-probs of the canary sequence
    differ from the actor's after a corrupted load, and the error names the tensor."""
    actor, rollout = groups(tiny_path, "process", 2, verify_weights="never")
    store = sc.WeightStore(parent=str(tmp_path))
    try:
        clean = rollout.load_weights(actor.publish_weights(1, store.root, 0.05), version=1)
        assert all(m["sync/canary_gap"] <= 0.05 for m in clean)
        actor.update_policy(_update_batch(tiny_path, rollout))
        corrupted = actor.publish_weights(2, store.root, 0.05)
        entry = next(e for e in corrupted.entries if e.name == "model.layers.0.self_attn.q_proj.weight")
        with open(f"{store.root}/slot-{corrupted.slot}-{entry.writer}.bin", "r+b") as f:
            f.seek(entry.offset)
            f.write(b"\x00\x00\x80\x7f" * 64)  # infs where weights were
        with pytest.raises(
            sc.WorkerError, match=r"WeightCanaryError.*'model.layers.0.self_attn.q_proj.weight'"
        ):
            rollout.load_weights(corrupted, version=2)
    finally:
        actor.shutdown()
        rollout.shutdown()
        store.close()


def _update_batch(tiny_path: str, rollout: sc.WorkerGroup):
    sampled = rollout.generate(prompt_batch(load_tokenizer(tiny_path), TEXTS))
    sampled.batch["advantages"] = (
        torch.ones(sampled.batch["responses"].shape) * sampled.batch["response_mask"]
    )
    return sampled.select(batch_keys=ACTOR_UPDATE_KEYS)


@pytest.mark.timeout(180)
def test_a_replicated_actor_publishes_its_gathered_weights_step_after_step(tiny_path, tmp_path):
    """fsdp_size=1 (each rank holds the whole model): no shard to write, so rank 0 publishes the
    gathered weights; FSDP frees them again after each publication (a numpy view of their storage
    would have made that fail)."""
    actor, rollout = groups(tiny_path, "process", 2, fsdp_size=1)
    store = sc.WeightStore(parent=str(tmp_path))
    try:
        for version in (1, 2):
            generation = actor.publish_weights(version, store.root)
            assert generation.writers == 1 and all(e.rows is None for e in generation.entries)
            rollout.load_weights(generation, version)
            actor.update_policy(_update_batch(tiny_path, rollout))
        exported = actor.export_weights()
        rollout.load_weights(actor.publish_weights(3, store.root), 3)
        for version, weights in rollout.weights():
            assert version == 3 and all(torch.equal(weights[n], exported[n]) for n in exported)
    finally:
        actor.shutdown()
        rollout.shutdown()
        store.close()
