"""The actor's policy update (rl_extension/roles/actor.py) across PPO epochs.

With one mini-batch per epoch the first epoch runs on the weights that sampled, so its log-probs
are the old ones: the update keeps them for the later epochs instead of needing a separate
``compute_log_prob`` pass. It must land on the same weights as an update given that pass's values.

Run: python -m pytest tests/rl/test_actor.py -q
"""

from __future__ import annotations

import pytest
import torch
from batches import build_small_model, prompt_batch

import spmdcall as sc
from rl_extension.config import ActorConfig, ModelConfig, RolloutConfig
from rl_extension.models import load_tokenizer
from rl_extension.roles import Actor, HFRollout
from rl_extension.roles.keys import ACTOR_UPDATE_KEYS

TEXTS = ["12+34=", "7+5=", "903+88=", "1+1=", "45+45=", "600+7="]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_small_model(tmp_path_factory.mktemp("actor") / "tiny")


@pytest.fixture(scope="module")
def sampled(tiny_path):
    """Responses sampled from the tiny model, with random advantages on their tokens."""
    rollout = sc.WorkerGroup(
        sc.ResourcePool([1]),
        sc.ClassWithInitArgs(
            HFRollout,
            ModelConfig(path=tiny_path),
            RolloutConfig(n=2, max_new_tokens=6),
            model_path=tiny_path,
            tokenizer_path=tiny_path,
        ),
        backend="inline",
    )
    try:
        batch = rollout.generate(prompt_batch(load_tokenizer(tiny_path), TEXTS))
    finally:
        rollout.shutdown()
    advantages = torch.randn(batch.batch["responses"].shape, generator=torch.Generator().manual_seed(0))
    batch.batch["advantages"] = advantages * batch.batch["response_mask"]
    return batch.select(batch_keys=ACTOR_UPDATE_KEYS)


def actor_group(tiny_path, num_mini_batches: int = 1) -> sc.WorkerGroup:
    config = ActorConfig(lr=1e-2, ppo_epochs=3, ppo_mini_batch_size=1, micro_batch_size_per_worker=4)
    actor = sc.ClassWithInitArgs(
        Actor,
        ModelConfig(path=tiny_path),
        config,
        model_path=tiny_path,
        num_mini_batches=num_mini_batches,
        total_steps=10,
        threads=1,
    )
    return sc.WorkerGroup(sc.ResourcePool([2]), actor, backend="process")


@pytest.mark.timeout(240)
def test_epochs_after_the_first_reuse_its_log_probs_as_the_old_ones(tiny_path, sampled):
    after = {}
    for given in (True, False):
        group = actor_group(tiny_path)
        try:
            before = group.compute_log_prob(sampled).batch["old_log_prob"]
            batch = sampled.select()  # new columns go to a copy, not to the fixture
            if given:  # as the trainer does with several mini-batches: a forward of its own
                batch.union(group.compute_log_prob(sampled))
            metrics = group.update_policy(batch)
            after[given] = group.compute_log_prob(sampled).batch["old_log_prob"]
        finally:
            group.shutdown()
        # Epochs 2 and 3 ran off the sampling policy, and saw it: their ratios moved away from 1.
        assert all(rank["actor/ppo_kl"] != 0.0 for rank in metrics), metrics
    mask = sampled.batch["response_mask"].bool()
    assert (after[True] - before).abs()[mask].max() > 1e-2  # the update changed the policy
    torch.testing.assert_close(after[False][mask], after[True][mask], atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(120)
def test_several_mini_batches_need_old_log_prob(tiny_path, sampled):
    group = actor_group(tiny_path, num_mini_batches=2)
    try:
        with pytest.raises(
            sc.WorkerError, match="ValueError: update_policy needs old_log_prob with num_mini_batches=2"
        ):
            group.update_policy(sampled)
    finally:
        group.shutdown()
