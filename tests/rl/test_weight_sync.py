"""Weight sync from the FSDP2 actor into a colocated HF rollout (rl_extension/roles/rollout.py).

``fsdp.gathered_params`` hands out every rank's full parameters without a state-dict copy and
shards them again on exit; ``HFRollout.sync_weights`` copies them into the rollout's model. The
vLLM rollout's sync is tested in test_vllm.py (skipped where vLLM is not installed).

Run: python -m pytest tests/rl/test_weight_sync.py -q
"""

from __future__ import annotations

import pytest
import torch
from batches import build_small_model, prompt_batch, with_meta

import spmdcall as sc
from rl_extension import fsdp
from rl_extension.config import ActorConfig, ModelConfig, RolloutConfig
from rl_extension.models import load_causal_lm, load_tokenizer
from rl_extension.roles import Actor, HFRollout
from rl_extension.roles.keys import ACTOR_UPDATE_KEYS, FORWARD_KEYS

TEXTS = ["12+34=", "7+5=", "903+88=", "1+1="]


class GatherProbe(sc.Worker):
    """Shards the tiny model with FSDP2 and reports what ``gathered_params`` gives."""

    def __init__(self, path: str, fsdp_size: int = -1, compute_dtype: str = ""):
        fsdp.setup_worker(threads=1)
        model = fsdp.load_model(ModelConfig(path=path), path, torch.device("cpu"))
        self.model = fsdp.shard(model, fsdp_size=fsdp_size, compute_dtype=compute_dtype)

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def dtypes(self) -> dict[str, set]:
        """The dtypes of the shards, of the gathered parameters, and of the gradients after a backward."""
        ids = torch.randint(3, 60, (4, 10), generator=torch.Generator().manual_seed(self.rank))
        self.model(input_ids=ids, labels=ids).loss.backward()
        with fsdp.gathered_params(self.model) as params:
            gathered = {t.dtype for t in params.values()}
        grads = {p.grad.dtype for p in self.model.parameters()}
        self.model.zero_grad(set_to_none=True)
        return {"shards": {p.dtype for p in self.model.parameters()}, "gathered": gathered, "grads": grads}

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def sgd_step(self) -> dict[str, torch.Tensor]:
        """One SGD step on this rank's own rows; returns the full weights after it (float32)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        ids = torch.randint(3, 60, (4, 10), generator=torch.Generator().manual_seed(self.rank))
        self.model(input_ids=ids, labels=ids).loss.backward()
        torch.optim.SGD(self.model.parameters(), lr=0.5).step()
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def check(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor

        reference = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        with fsdp.gathered_params(self.model) as params:
            names = sorted(params)
            equal = all(torch.equal(params[name], reference[name]) for name in reference)
            shapes_full = all(params[name].shape == reference[name].shape for name in reference)
            tied = params["lm_head.weight"].data_ptr() == params["model.embed_tokens.weight"].data_ptr()
        sharded_again = all(isinstance(p, DTensor) for p in self.model.parameters())
        return {
            "names": names,
            "reference_names": sorted(reference),
            "equal": equal,
            "shapes_full": shapes_full,
            "tied": tied,
            "sharded_again": sharded_again,
        }


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_small_model(tmp_path_factory.mktemp("sync") / "tiny")


@pytest.mark.timeout(180)
def test_gathered_params_are_the_full_state_dict_and_reshard_on_exit(tiny_path):
    group = sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(GatherProbe, tiny_path), backend="process"
    )
    try:
        results = group.check()
    finally:
        group.shutdown()
    for result in results:
        assert result["names"] == result["reference_names"]  # lm_head.weight listed although tied
        assert result["equal"] and result["shapes_full"] and result["tied"], result
        assert result["sharded_again"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    # bf16: the rollout's generate (KV cache) and the actor's forward may round differently
    "compute_dtype, tolerance",
    [("", 1e-4), ("bfloat16", 1e-2)],
)
def test_hf_rollout_takes_the_actor_weights_after_an_update(tiny_path, compute_dtype, tolerance):
    model = ModelConfig(path=tiny_path, compute_dtype=compute_dtype)
    rollout = RolloutConfig(n=2, max_new_tokens=6, compute_log_probs=True)
    roles = {
        # A large learning rate: one optimizer step must change the greedy log-probs visibly.
        "actor": sc.ClassWithInitArgs(
            Actor,
            model,
            ActorConfig(lr=1e-2, ppo_mini_batch_size=1),
            model_path=tiny_path,
            num_mini_batches=1,
            total_steps=10,
            threads=1,
        ),
        "rollout": sc.ClassWithInitArgs(
            HFRollout, model, rollout, model_path=tiny_path, tokenizer_path=tiny_path
        ),
    }
    group = sc.WorkerGroup(sc.ResourcePool([2]), sc.colocate(roles), backend="process", name="sync_test")
    try:
        spawned = group.spawn({"actor", "rollout"})
        actor, hf = spawned["actor"], spawned["rollout"]
        prompts = prompt_batch(load_tokenizer(tiny_path), TEXTS)
        greedy = with_meta(prompts, do_sample=False)
        before = hf.generate(greedy)

        sampled = hf.generate(prompts)
        advantages = torch.randn(sampled.batch["responses"].shape, generator=torch.Generator().manual_seed(0))
        sampled.batch["advantages"] = advantages * sampled.batch["response_mask"]
        actor.update_policy(sampled.select(batch_keys=ACTOR_UPDATE_KEYS))

        stale = hf.generate(greedy)  # not synced yet: the rollout still has the old weights
        assert torch.allclose(stale.batch["rollout_log_prob"], before.batch["rollout_log_prob"], atol=1e-6)
        hf.sync_weights()
        after = hf.generate(greedy)
        mask = after.batch["response_mask"]
        actor_log_prob = actor.compute_log_prob(after.select(batch_keys=FORWARD_KEYS)).batch["old_log_prob"]
        gap = float(((after.batch["rollout_log_prob"] - actor_log_prob).abs() * mask).max())
        change = float(
            ((after.batch["rollout_log_prob"] - before.batch["rollout_log_prob"]).abs() * mask).max()
        )
        print(f"compute_dtype={compute_dtype or 'float32'}: rollout/actor gap {gap:.2e}, change {change:.2e}")
        assert gap < tolerance
        assert change > 1e-1, "the rollout still has the old weights after sync_weights"
    finally:
        group.shutdown()


@pytest.mark.timeout(180)
def test_replicated_and_sharded_models_take_the_same_step(tiny_path):
    """fsdp_size=1 (every rank a full copy, gradients all-reduced) trains as full sharding does."""
    after = {}
    for size in (-1, 1):
        init = sc.ClassWithInitArgs(GatherProbe, tiny_path, fsdp_size=size)
        group = sc.WorkerGroup(sc.ResourcePool([2]), init, backend="process")
        try:
            after[size] = group.sgd_step()
        finally:
            group.shutdown()
    start = load_causal_lm(tiny_path).state_dict()
    for name, sharded in after[-1][0].items():
        assert torch.allclose(after[1][0][name], sharded, atol=1e-6), name
        assert torch.allclose(after[1][1][name], sharded, atol=1e-6), name  # both copies alike
    assert any(not torch.allclose(start[n], t) for n, t in after[-1][0].items()), "the step changed nothing"


@pytest.mark.timeout(180)
def test_mixed_precision_computes_in_bf16_and_keeps_fp32_shards(tiny_path):
    """compute_dtype=bfloat16: gathered parameters (forward, backward, rollout sync) in bf16; shards,
    gradients and so the optimizer in float32; the step close to the float32 one."""
    after, dtypes = {}, None
    for compute_dtype in ("", "bfloat16"):
        init = sc.ClassWithInitArgs(GatherProbe, tiny_path, compute_dtype=compute_dtype)
        group = sc.WorkerGroup(sc.ResourcePool([2]), init, backend="process")
        try:
            if compute_dtype:
                dtypes = group.dtypes()
            after[compute_dtype] = group.sgd_step()[0]
        finally:
            group.shutdown()
    for rank_dtypes in dtypes:
        assert rank_dtypes == {
            "shards": {torch.float32},
            "gathered": {torch.bfloat16},
            "grads": {torch.float32},
        }
    start = load_causal_lm(tiny_path).state_dict()
    delta = {p: torch.cat([(after[p][n] - start[n]).flatten() for n in start]) for p in after}
    assert delta["bfloat16"].dtype == torch.float32
    similarity = torch.nn.functional.cosine_similarity(delta[""], delta["bfloat16"], dim=0)
    assert 0.95 < float(similarity) < 1.0 - 1e-6, similarity  # the same step, but not bit for bit


def test_fsdp_size_must_divide_the_world():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="fsdp_size=3 must be -1"):
        fsdp.shard(model, fsdp_size=3)


@pytest.mark.parametrize(
    "device, amx, cuda_bf16, expected",
    [
        ("cpu", False, False, ("", "sdpa")),  # AVX2/AVX-512 CPUs: bf16 matmuls are emulated, slow
        ("cpu", True, False, ("bfloat16", "eager")),  # AMX: native bf16; CPU sdpa backward is slow in it
        ("cuda", False, True, ("bfloat16", "sdpa")),
        ("cuda", False, False, ("", "sdpa")),  # pre-Ampere GPUs
    ],
)
def test_auto_precision_picks_bf16_only_where_the_hardware_computes_it(
    monkeypatch, device, amx, cuda_bf16, expected
):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda_bf16)
    auto = ModelConfig(path="m", compute_dtype="auto", attn_implementation="auto")
    resolved = fsdp.resolve_precision(auto, torch.device(device))
    assert (resolved.compute_dtype, resolved.attn_implementation) == expected
    assert resolved.path == "m" and auto.compute_dtype == "auto"  # a copy; the rest kept
    explicit = ModelConfig(path="m", compute_dtype="bfloat16", attn_implementation="sdpa")
    assert fsdp.resolve_precision(explicit, torch.device(device)) == explicit
