"""One model turn of a trajectory: the request the agent loop sends, the output it gets back, the
dispatch mode that routes requests to the rollout's ranks, and sampling a batch of turns with
transformers (the HF rollout's engine).

Each rollout engine has a group method ``generate_turns(requests) -> outputs`` registered with
``TURNS_DISPATCH``: request i goes to rank ``requests[i].route % world_size``, and the result is
one list of outputs per rank, in the order of that rank's requests.

Every request carries its own seed, so what a turn samples does not depend on which other turns
shared its batch (the HF engine samples each row from its own generator, vLLM takes a seed per
request): a run with a fixed seed repeats itself, however tool latencies order the turns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache

import spmdcall as sc

__all__ = ["TURNS_DISPATCH", "Sampling", "TurnOutput", "TurnRequest", "decode_turns"]


@dataclass(frozen=True)
class Sampling:
    """How the turns of one rollout call are sampled (shared by its requests)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    log_probs: bool = False


@dataclass(frozen=True)
class TurnRequest:
    """Generate one turn: continue ``token_ids`` (prompt + the trajectory so far) by at most ``max_tokens``.

    Attributes:
        token_ids: the whole context, unpadded.
        max_tokens: tokens this turn may generate.
        seed: seeds this turn's sampling (ignored when greedy).
        sampling: temperature, top-p, top-k, greedy, log-probs.
        route: which rank serves it (``route % world_size``).
    """

    token_ids: list[int]
    max_tokens: int
    seed: int
    sampling: Sampling
    route: int = 0


@dataclass(frozen=True)
class TurnOutput:
    """The tokens of one turn, their sampling log-probs (empty unless asked), whether a stop token
    ended it (False: it ran out of ``max_tokens``), and the version of the weights that sampled it."""

    token_ids: list[int]
    log_probs: list[float]
    stopped: bool
    policy_version: int = 0


def _dispatch_turns(group, requests: list[TurnRequest]):
    per_rank: list[list[TurnRequest]] = [[] for _ in range(group.world_size)]
    for request in requests:
        per_rank[request.route % group.world_size].append(request)
    return (per_rank,), {}


def _collect_turns(group, outputs: list) -> list[list[TurnOutput]]:
    return list(outputs)


TURNS_DISPATCH = sc.register_dispatch_mode("rl_extension.turns", _dispatch_turns, _collect_turns)
"""Request i to rank ``route % world_size``; one list of outputs per rank back."""


def _filter_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Temperature, top-k and top-p, as transformers' warpers apply them (masked logits are -inf)."""
    logits = logits / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > sampling.top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def _as_int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (_as_int64(v) for v in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps; shifts made logical)."""

    def shift(x: torch.Tensor, k: int) -> torch.Tensor:
        return (x >> k) & ((1 << (64 - k)) - 1)

    z = (z ^ shift(z, 30)) * _MIX1
    z = (z ^ shift(z, 27)) * _MIX2
    return z ^ shift(z, 31)


def _gumbel_noise(seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise of shape (rows, vocab), a function of (seed, step, token) only: a row's
    draws do not depend on the other rows of its batch, and one call serves the whole batch."""
    keys = _mix(seeds[:, None] + _GOLDEN) + step * vocab + torch.arange(vocab, device=seeds.device)
    bits = (_mix(keys + _GOLDEN) >> 11) & ((1 << 53) - 1)
    uniform = (bits.double() + 0.5) / float(1 << 53)  # in (0, 1)
    return -torch.log(-torch.log(uniform)).float()


@torch.no_grad()
def decode_turns(
    model: torch.nn.Module,
    requests: list[TurnRequest],
    *,
    stop_token_ids: list[int],
    pad_token_id: int,
    micro_batch_size: int = 0,
    policy_version: int = 0,
) -> list[TurnOutput]:
    """Generate one turn per request with a KV cache, every request in one batch (or micro-batches).

    Rows are left-padded; each stops at its first stop token (kept) or after its ``max_tokens``.
    A sampled row's draws depend only on its request's seed (Gumbel-max sampling with noise that
    is a hash of seed, position and token), not on the other rows of its batch.

    Args:
        model: a causal LM (transformers), in eval mode.
        requests: the turns to generate; all share one ``Sampling``.
        stop_token_ids: tokens that end a turn.
        pad_token_id: the padding of the prompts.
        micro_batch_size: rows per forward; 0: all at once.
        policy_version: the version of ``model``'s weights, recorded on every output.
    """
    step = micro_batch_size or max(len(requests), 1)
    outputs: list[TurnOutput] = []
    for start in range(0, len(requests), step):
        outputs += _decode_batch(model, requests[start : start + step], stop_token_ids, pad_token_id)
    return [replace(out, policy_version=policy_version) for out in outputs]


def _decode_batch(
    model: torch.nn.Module, requests: list[TurnRequest], stop_token_ids: list[int], pad_token_id: int
) -> list[TurnOutput]:
    if not requests:
        return []
    device = next(model.parameters()).device
    sampling, rows = requests[0].sampling, len(requests)
    input_ids, attention_mask = _left_padded(requests, pad_token_id, device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    max_tokens = torch.tensor([r.max_tokens for r in requests], device=device)
    seeds = torch.tensor([r.seed for r in requests], dtype=torch.long, device=device)
    stop = torch.tensor(stop_token_ids, device=device)

    cache = DynamicCache()
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    next_position = position_ids[:, -1:] + 1
    done = max_tokens <= 0
    tokens: list[torch.Tensor] = []
    log_probs: list[torch.Tensor] = []
    for t in range(int(max_tokens.max())):
        scores = logits.float() if sampling.greedy else _filter_logits(logits.float(), sampling)
        if sampling.greedy:
            token = scores.argmax(-1)
        else:
            # argmax(log p + Gumbel noise) is a draw from p.
            token = (scores.log_softmax(-1) + _gumbel_noise(seeds, t, scores.shape[-1])).argmax(-1)
        if sampling.log_probs:
            log_probs.append(scores.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1))
        token = torch.where(done, pad_token_id, token)
        tokens.append(token)
        done = done | torch.isin(token, stop) | (t + 1 >= max_tokens)
        if bool(done.all()):
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((rows, 1))], dim=1)
        logits = model(
            input_ids=token[:, None],
            attention_mask=attention_mask,
            position_ids=next_position,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
        next_position = next_position + 1

    generated = torch.stack(tokens, dim=1).cpu() if tokens else torch.zeros((rows, 0), dtype=torch.long)
    picked = torch.stack(log_probs, dim=1).cpu() if log_probs else None
    return _turn_outputs(requests, generated, picked, stop_token_ids)


def _left_padded(
    requests: list[TurnRequest], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests' token ids left-padded to one width, and their attention mask, on ``device``."""
    rows, width = len(requests), max(len(r.token_ids) for r in requests)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    for i, r in enumerate(requests):
        input_ids[i, width - len(r.token_ids) :] = torch.tensor(r.token_ids, dtype=torch.long)
        attention_mask[i, width - len(r.token_ids) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def _turn_outputs(
    requests: list[TurnRequest],
    generated: torch.Tensor,
    picked: torch.Tensor | None,
    stop_token_ids: list[int],
) -> list[TurnOutput]:
    """Each request's generated tokens up to and with its first stop token (at most its max_tokens)."""
    outputs = []
    for i, r in enumerate(requests):
        row = generated[i, : r.max_tokens].tolist()
        stops = [k for k, token in enumerate(row) if token in stop_token_ids]
        length = stops[0] + 1 if stops else len(row)
        outputs.append(
            TurnOutput(
                token_ids=row[:length],
                log_probs=picked[i, :length].tolist() if picked is not None else [],
                stopped=bool(stops),
            )
        )
    return outputs
