"""The rollout: sample responses to prompts from the current policy.

Any rollout engine implements the same four group methods, so the trainer picks one by
``rollout.name`` and never looks inside:

- ``generate(prompts) -> DataProto`` (``DP_COMPUTE_PROTO``): ``n`` samples per prompt, interleaved
  (a prompt's samples are adjacent), with tensors ``prompts``, ``responses`` and ``response_mask``
  (rows, max_new_tokens; right-padded, the eos token included in the mask), ``input_ids``,
  ``attention_mask`` and ``position_ids`` over prompt + response, optionally
  ``rollout_log_prob``, ``policy_version`` (the version of the weights that sampled each response
  token, -1 on padding), and every non-tensor column of the prompts repeated (``uid`` groups a
  prompt's samples). ``meta_info`` options: ``validate`` (greedy by default: rollout.val_*),
  ``n``, ``temperature``, ``do_sample``. The output's ``meta_info["temperature"]`` says what was used.
- ``sync_weights()``: take the current weights of the colocated role ``actor`` (``self.sibling("actor")``).
- ``load_weights(weights, version)`` (``ONE_TO_ALL``): take weights from an actor in another group,
  in place, and record ``policy_version = version``: the asynchronous mode's rollout lives on its
  own pool. ``weights`` is a ``WeightGeneration`` (``actor.publish_weights(version, store.root)``:
  read from shared memory, what changed only, checksums checked; returns the ``sync/*`` metrics)
  or a state dict (``actor.export_weights()``, or its future).
- ``load_newest_weights(root)`` (``ONE_TO_ALL``): the newest generation of a weight store, for a
  rank that (re)starts with no help from the trainer. ``policy_version`` starts at 0 (the
  checkpoint's weights); ``generate`` and ``generate_turns`` tag the tokens they sample with it.
- ``save_checkpoint(path)`` / ``load_checkpoint(path)``: the sampling RNG state of each rank.
- ``NEEDS_PROCESS_GROUP`` (a class attribute): whether the ranks share a torch.distributed process
  group (then a dead one is replaced by restarting them all; else alone).
- ``generate_turns(requests) -> outputs`` (``TURNS_DISPATCH``): one turn per request, for the agent
  loop of ``rl_extension.agents`` (``rollout.multi_turn``); ``TURN_CALLS_IN_FLIGHT`` says how many
  such calls the agent loop keeps in flight (0: no limit).

``HFRollout`` is the engine needing nothing but transformers: ``generate`` on a full local copy of
the policy, refreshed from the actor in the same process. ``VLLMRollout`` (``vllm_rollout.py``) runs
a vLLM engine in the same place.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping
from pathlib import Path

import torch
from transformers import GenerationConfig

import spmdcall as sc
from rl_extension import fsdp
from rl_extension.agents.turns import TURNS_DISPATCH, TurnOutput, TurnRequest, decode_turns
from rl_extension.config import ModelConfig, RolloutConfig
from rl_extension.models import load_tokenizer
from rl_extension.roles.weight_sync import RolloutWeights, check_canary, model_log_probs
from spmdcall.data import DataProto, WeightGeneration, WeightReader

__all__ = [
    "HFRollout",
    "ROLLOUTS",
    "check_weights",
    "check_version",
    "concat_rollouts",
    "parameter_layout",
    "generate_responses",
    "replace_responses",
    "response_mask_from_eos",
    "rollout_batch",
]


# RolloutConfig fields only the vLLM engine reads.
VLLM_ONLY_FIELDS = (
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "max_model_len",
    "enforce_eager",
    "enable_sleep_mode",
    "engine_kwargs",
)


def response_mask_from_eos(responses: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """1 on every token up to and including the first eos of each row, 0 after it (int64)."""
    is_eos = torch.isin(responses, torch.tensor(eos_token_ids, device=responses.device))
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # eos tokens strictly before t
    return (eos_before == 0).long()


@torch.no_grad()
def generate_responses(
    model: torch.nn.Module,
    prompts: DataProto,
    *,
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    do_sample: bool,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    micro_batch_size: int = 0,
    return_log_probs: bool = False,
    policy_version: int = 0,
) -> DataProto:
    """One response per row of ``prompts`` (left-padded ``input_ids`` + ``attention_mask``), as described above.

    Every generation setting is explicit, so a checkpoint's own generation_config (a repetition
    penalty, a default top_k) never changes what is sampled.
    """
    config = GenerationConfig(
        do_sample=do_sample,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_ids,
        pad_token_id=pad_token_id,
        temperature=temperature if do_sample else None,
        top_p=top_p if do_sample else None,
        # top_k=0 switches the top-k filter off; None would fall back to transformers' default of 50.
        top_k=top_k if do_sample else None,
        repetition_penalty=1.0,
        num_beams=1,
        output_scores=return_log_probs,
        return_dict_in_generate=True,
    )
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    step = micro_batch_size or len(prompts)
    responses, log_probs = [], []
    for start in range(0, len(prompts), step):
        ids = prompt_ids[start : start + step].to(device)
        out = model.generate(
            input_ids=ids,
            attention_mask=prompt_mask[start : start + step].to(device),
            generation_config=config,
        )
        generated = out.sequences[:, ids.shape[1] :]
        pad = max_new_tokens - generated.shape[1]  # generation stops early once every row has ended
        responses.append(torch.nn.functional.pad(generated, (0, pad), value=pad_token_id).cpu())
        if return_log_probs:
            scores = torch.stack(out.scores, dim=1).float()  # the processed logits the tokens were drawn from
            picked = torch.log_softmax(scores, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
            log_probs.append(torch.nn.functional.pad(picked, (0, pad), value=0.0).cpu())
    return rollout_batch(
        prompts,
        torch.cat(responses),
        eos_token_ids,
        log_probs=torch.cat(log_probs) if return_log_probs else None,
        policy_version=policy_version,
    )


def rollout_batch(
    prompts: DataProto,
    responses: torch.Tensor,
    eos_token_ids: list[int],
    log_probs: torch.Tensor | None = None,
    policy_version: int = 0,
) -> DataProto:
    """The output of ``generate`` from one response per prompt row (every engine builds it here).

    Args:
        prompts: the prompt rows (left-padded ``input_ids``, ``attention_mask``, ``position_ids``).
        responses: (rows, max_new_tokens) token ids, padded on the right after the eos.
        eos_token_ids: the tokens that end a response (the first one is kept in the mask).
        log_probs: (rows, max_new_tokens) sampling log-probs, or None; zeroed past each response.
        policy_version: the version of the weights that sampled ``responses`` (``policy_version`` column).
    """
    prompt_ids, prompt_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    max_new_tokens = responses.shape[1]
    response_mask = response_mask_from_eos(responses, eos_token_ids)
    # Positions count real tokens, as in the prompt (left padding sits at position 0).
    last_prompt_pos = prompts.batch["position_ids"][:, -1:]
    position_ids = torch.cat(
        [prompts.batch["position_ids"], last_prompt_pos + torch.arange(1, max_new_tokens + 1).unsqueeze(0)],
        dim=1,
    )
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "position_ids": position_ids,
        "policy_version": torch.where(response_mask.bool(), policy_version, -1),
    }
    if log_probs is not None:
        # Rows that ended early have -inf scores past their eos: zero them, never multiply (nan).
        tensors["rollout_log_prob"] = torch.where(response_mask.bool(), log_probs, 0.0)
    return DataProto.from_dict(tensors, dict(prompts.non_tensor_batch))


def replace_responses(
    batch: DataProto,
    rows: list[int],
    responses: list[list[int]],
    pad_token_id: int,
    masks: list[list[int]] | None = None,
) -> None:
    """Write ``responses`` (token ids, eos included) into ``rows`` of a ``generate`` output, in place, as
    a sampler (or the agent loop) would have: ``responses``, ``input_ids``, ``attention_mask`` (1 on
    every token) and ``response_mask``: 1 on every token, or ``masks`` (0 on a trajectory's tool
    results). No sampler drew them, so their ``rollout_log_prob`` becomes 0.

    Args:
        batch: a ``generate`` (or agent loop) output, changed in place.
        rows: the rows to overwrite.
        responses: one list of token ids per row, at most the batch's response width.
        pad_token_id: fills each row after its response.
        masks: one response mask per row (the length of its response), or None for all ones.
    """
    data = batch.batch
    prompt_width, width = data["prompts"].shape[1], data["responses"].shape[1]
    for i, (row, ids) in enumerate(zip(rows, responses, strict=True)):
        if not 0 < len(ids) <= width:
            raise ValueError(f"a response of {len(ids)} tokens does not fit the batch's {width} columns")
        tokens = torch.full((width,), pad_token_id, dtype=data["responses"].dtype)
        tokens[: len(ids)] = torch.tensor(ids, dtype=tokens.dtype)
        real = (torch.arange(width) < len(ids)).to(data["response_mask"].dtype)
        loss = real.clone()
        if masks is not None:
            loss[: len(ids)] = torch.tensor(masks[i], dtype=loss.dtype)
        data["responses"][row] = tokens
        data["input_ids"][row, prompt_width:] = tokens
        data["response_mask"][row] = loss
        data["attention_mask"][row, prompt_width:] = real
        if "rollout_log_prob" in data.keys():
            data["rollout_log_prob"][row] = 0.0


def check_weights(
    weights: object, expected: Mapping[str, tuple[int, ...]], also_known: Collection[str] = ()
) -> Mapping[str, torch.Tensor]:
    """``weights`` if it holds a tensor of the right shape under every name of ``expected``;
    else a ``ValueError`` (``TypeError`` for something other than a dict of tensors) naming what
    is missing, what the model does not know (``also_known``: names it accepts besides, such as a
    tied weight's second name) and the shapes that differ."""
    if not isinstance(weights, Mapping) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise TypeError(
            f"load_weights takes a dict of name -> tensor (actor.export_weights()), got {type(weights).__name__}"
        )
    missing = sorted(expected.keys() - weights.keys())
    unknown = sorted(weights.keys() - expected.keys() - set(also_known))
    if missing or unknown:
        raise ValueError(
            f"the weights do not fit the rollout's model: missing {_some(missing)}, "
            f"not in the model {_some(unknown)}; were they exported from the same model?"
        )
    wrong = [
        f"{n} {tuple(weights[n].shape)}, expected {s}"
        for n, s in expected.items()
        if tuple(weights[n].shape) != s
    ]
    if wrong:
        raise ValueError(f"the weights do not fit the rollout's model: shapes {_some(wrong)}")
    return weights


def parameter_layout(model: torch.nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """The shapes of ``model``'s parameters by name (a tied one under its first name only, as
    ``named_parameters`` lists it) and every other name of a tied parameter -> its first name."""
    first: dict[int, str] = {}
    shapes, aliases = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)], shapes[name] = name, tuple(p.shape)
    return shapes, aliases


def check_version(version: object) -> int:
    """``version`` if it is a policy version (an int >= 0), else a ``TypeError``/``ValueError``."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"load_weights: version must be an int (the policy version), got {version!r}")
    if version < 0:
        raise ValueError(f"load_weights: version must be >= 0, got {version}")
    return version


def _some(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{names[:limit]}{more}"


# Columns of a rollout batch that span prompt + response (or the prompt alone): left-padded together.
_PROMPT_WIDTH_COLUMNS = {"prompts": "pad", "input_ids": "pad", "attention_mask": 0, "position_ids": 0}


def concat_rollouts(batches: list[DataProto], pad_token_id: int) -> DataProto:
    """Rows of several ``generate`` outputs in one batch, prompts left-padded to the widest.

    Prompt batches are padded to their own longest prompt, so two rounds of sampling may differ in
    prompt width; padding on the left keeps every prompt ending in the same column (pads are masked
    and sit at position 0, as ``PromptLoader`` pads them).
    """
    width = max(b.batch["prompts"].shape[1] for b in batches)
    padded = []
    for b in batches:
        missing = width - b.batch["prompts"].shape[1]
        if missing:
            b = b.select()  # a copy: the caller's batch keeps its columns
            for key, value in _PROMPT_WIDTH_COLUMNS.items():
                fill = pad_token_id if value == "pad" else value
                b.batch[key] = torch.nn.functional.pad(b.batch[key], (missing, 0), value=fill)
        padded.append(b)
    return DataProto.concat(padded) if len(padded) > 1 else padded[0]


class HFRollout(sc.Worker):
    """Samples with transformers ``generate`` on a full copy of the policy, colocated with the actor.

    For the agent loop it serves one batch of turns at a time (``TURN_CALLS_IN_FLIGHT = 1``): the
    turns that become pending while a batch generates go out together in the next call.

    Args:
        model: dtype and attention kernel of the copy.
        config: sampling settings.
        model_path: the checkpoint to start from (the actor's).
        tokenizer_path: where the eos/pad tokens come from.
        seed: seeds sampling (each rank differently).
        threads: torch threads (0: a share of the cores).
        use_gpu: generate on this rank's GPU.
    """

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
        ignored = [k for k in VLLM_ONLY_FIELDS if getattr(config, k) != getattr(RolloutConfig(), k)]
        if ignored and self.rank == 0:
            warnings.warn(f"rollout.name=hf ignores the vLLM settings {ignored}", stacklevel=2)
        self.config = config
        self.device = fsdp.setup_worker(threads, use_gpu, distributed=self.NEEDS_PROCESS_GROUP)
        model = fsdp.resolve_precision(model, self.device)
        self.model = fsdp.load_model(model, model_path, self.device, dtype=model.compute_dtype).eval()
        self.model.requires_grad_(False)
        tokenizer = load_tokenizer(tokenizer_path)
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_token_ids = sorted(set(eos) | {tokenizer.eos_token_id})
        self.pad_token_id = tokenizer.pad_token_id
        self.policy_version = 0  # the checkpoint's weights; load_weights sets it
        self.weight_sync = RolloutWeights(verify=config.verify_weights)
        torch.manual_seed(seed * 1000 + self.rank)  # every rank samples differently

    TURN_CALLS_IN_FLIGHT = 1
    NEEDS_PROCESS_GROUP = False  # ranks never talk to each other: one can be restarted alone

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def generate(self, prompts: DataProto) -> DataProto:
        """``n`` responses per prompt (interleaved); see the module docstring for the columns."""
        cfg, meta = self.config, prompts.meta_info
        validate = bool(meta.get("validate", False))
        n = int(meta.get("n", cfg.val_n if validate else cfg.n))
        temperature = float(meta.get("temperature", cfg.val_temperature if validate else cfg.temperature))
        do_sample = bool(meta.get("do_sample", temperature > 0))
        rows = prompts.repeat(n, interleave=True) if n > 1 else prompts
        out = generate_responses(
            self.model,
            rows,
            max_new_tokens=cfg.max_new_tokens,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            do_sample=do_sample,
            temperature=temperature if do_sample else 1.0,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            micro_batch_size=cfg.micro_batch_size_per_worker * n,
            return_log_probs=cfg.compute_log_probs and not validate,
            policy_version=self.policy_version,
        )
        out.meta_info.update({"temperature": temperature if do_sample else 1.0, "n": n, "validate": validate})
        return out

    @sc.register(dispatch_mode=TURNS_DISPATCH)
    def generate_turns(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        """One turn per request (the agent loop's), all in one batch (micro-batches of
        rollout.micro_batch_size_per_worker * n rows); each samples with its own seed."""
        return decode_turns(
            self.model,
            requests,
            stop_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            micro_batch_size=self.config.micro_batch_size_per_worker * self.config.n,
            policy_version=self.policy_version,
        )

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> None:
        """Copy the current weights of the colocated role ``actor`` into this rank's model (in process)."""
        with fsdp.gathered_params(self.sibling("actor").model) as weights:  # the full weights, no copy
            self._copy_weights(weights)

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def load_weights(
        self, weights: WeightGeneration | Mapping[str, torch.Tensor], version: int
    ) -> dict[str, float] | None:
        """Copy ``weights`` into this rank's model, in place, and record ``policy_version = version``.

        A ``WeightGeneration`` (``actor.publish_weights(version, store.root)``) is read from the
        store's shared memory: only the tensors that changed since this rank's last load are
        copied, each checked against its checksum (``rollout.verify_weights``); the ``sync/*``
        metrics of the load are returned. A state dict (``actor.export_weights()``, or its future)
        is copied whole.

        Args:
            weights: a weight generation, or name -> tensor with HF checkpoint names (a tied
                weight under one of its names).
            version: the policy version of these weights (an int >= 0).
        """
        version = check_version(version)
        if isinstance(weights, WeightGeneration):
            own = dict(self.model.named_parameters())
            stats = self.weight_sync.load_into(weights, own)
            self.policy_version = version if stats.number == weights.number else stats.version
            canary = check_canary(
                stats,
                lambda tokens: model_log_probs(self.model, tokens, self.device),
                lambda: WeightReader.first_difference(stats.generation or weights, own),
            )
            return stats.metrics() | canary
        self._copy_weights(weights)
        self.policy_version = version
        return None

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def load_newest_weights(self, root: str) -> int:
        """Load the newest generation of the weight store at ``root`` and return its version (what
        a restarted or new rank calls; the trainer need not resend anything)."""
        stats = self.weight_sync.load_into_newest(root, dict(self.model.named_parameters()))
        self.policy_version = stats.version
        return stats.version

    def _copy_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        own = dict(self.model.named_parameters())  # tied weights once
        check_weights(weights, *parameter_layout(self.model))
        self.weight_sync.forget()  # the next load from a weight store copies every tensor
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in own.values()], [weights[name] for name in own])

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """The sampling RNG state of this rank (the weights are the actor's)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(fsdp.rng_state(), Path(path) / f"rng_rank_{self.rank}.pt")

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore the RNG state (and call ``sync_weights`` after the actor has loaded its weights)."""
        file = Path(path) / f"rng_rank_{self.rank}.pt"
        if file.exists():
            fsdp.set_rng_state(torch.load(file, weights_only=False))


# rollout.name -> engine class; vllm_rollout.py adds "vllm". Every engine has the same four methods.
ROLLOUTS: dict[str, type] = {"hf": HFRollout}
