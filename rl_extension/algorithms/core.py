"""The math shared by PPO/GRPO's parts: masked statistics, prompt groups, loss aggregation, the
value loss, log-probs and entropies.

Pure torch (plus numpy for group ids), no other project imports, so every function can be tested
on CPU with hand-made tensors. The advantage estimators live in `rl_extension.algorithms.advantages`, the
policy losses in `rl_extension.algorithms.policy_losses` (each with its registry), KL penalties and KL
controllers in `rl_extension.algorithms.kl`.

Conventions (the estimators and losses follow them too):
  * token-level tensors are shaped (batch, response_len);
  * `response_mask` has the same shape; a nonzero entry marks a real response token. Values at
    masked positions never influence a result (they may be garbage, even inf or nan), and every
    token-level output is zero there;
  * a sequence-level score arrives as `token_level_rewards`: the score on the last response
    token, zeros elsewhere, so the sequence score is the masked sum over the row;
  * GRPO/RLOO group ids arrive as `index`, a numpy array with one prompt uid per row; rows with
    equal ids form a group.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "LOSS_AGG_MODES",
    "agg_loss",
    "compute_value_loss",
    "entropy_from_logits",
    "failed_group_rows",
    "group_ids",
    "informative_rows",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pick_groups",
    "uniform_group_fraction",
    "uniform_groups",
    "valid_mask",
]

# Rows of (rows, vocab) logits handled at once by `logprobs_from_logits`; bounds the float32
# temporaries to about _LOGPROB_CHUNK_ROWS * vocab * 4 bytes.
_LOGPROB_CHUNK_ROWS = 1024


# --- Masked statistics


def valid_mask(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` as bool: nonzero entries are valid."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` over the valid positions: sum_i x_i * [mask_i].

    Masked entries are replaced by 0 before summing, so inf/nan there cannot leak in.

    Args:
        x: any tensor.
        mask: same shape as `x`; nonzero marks a valid entry.
        dim: dimension to reduce; None reduces everything to a scalar.

    Returns:
        The masked sum, with `dim` reduced.

    Example:
        >>> masked_sum(torch.tensor([1.0, 2.0, 9.0]), torch.tensor([1, 1, 0]))
        tensor(3.)
    """
    masked = torch.where(valid_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over the valid positions: sum_i x_i [mask_i] / sum_i [mask_i].

    A reduction with no valid entry gives 0 (not nan).

    Args:
        x: any tensor.
        mask: same shape as `x`; nonzero marks a valid entry.
        dim: dimension to reduce; None reduces everything to a scalar.

    Returns:
        The masked mean, with `dim` reduced.

    Example:
        >>> masked_mean(torch.tensor([1.0, 2.0, 9.0]), torch.tensor([1, 1, 0]))
        tensor(1.5000)
    """
    count = masked_sum(torch.ones_like(x), mask, dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over all valid positions (a scalar).

    var = sum_i [mask_i] (x_i - mean)^2 / (n - 1)  (unbiased), or / n (biased), n = number valid.
    With fewer than two valid entries the unbiased correction is undefined and the biased value
    (0 for one entry, 0 for none) is returned.

    Args:
        x: any tensor.
        mask: same shape as `x`; nonzero marks a valid entry.
        unbiased: apply Bessel's correction n / (n - 1).

    Returns:
        A scalar tensor.

    Example:
        >>> masked_var(torch.tensor([1.0, 2.0, 3.0, 7.0]), torch.tensor([1, 1, 1, 0]))
        tensor(1.)
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = masked_sum(torch.ones_like(x), mask)
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), var)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise `x` with the mean and unbiased variance of its valid entries.

    whitened = (x - mean) / sqrt(var + eps); with `shift_mean=False` the mean is added back, so
    only the scale changes. Masked positions are set to 0.

    Args:
        x: any tensor.
        mask: same shape as `x`; nonzero marks a valid entry.
        shift_mean: keep the result centred at 0 (True) or at the original mean (False).
        eps: added to the variance before the square root.

    Returns:
        A tensor shaped like `x`.

    Example:
        >>> masked_whiten(torch.tensor([2.0, 4.0, 6.0]), torch.tensor([1, 1, 1]))
        tensor([-1.,  0.,  1.])
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid_mask(mask), whitened, torch.zeros_like(whitened))


# --- Groups: rows with equal ids in `index` (one prompt's samples)


def group_ids(index: np.ndarray, batch_size: int, device: torch.device) -> torch.Tensor:
    """Map each row's group id (any hashable) to 0..num_groups-1, in order of first appearance.

    Example:
        >>> group_ids(np.array(["b", "a", "b"], dtype=object), 3, torch.device("cpu"))
        tensor([0, 1, 0])
    """
    index = np.asarray(index, dtype=object)
    if index.shape != (batch_size,):
        raise ValueError(
            f"index must have one group id per row: expected shape ({batch_size},), got {index.shape}"
        )
    first_seen: dict = {}
    ids = [first_seen.setdefault(uid, len(first_seen)) for uid in index.tolist()]
    return torch.tensor(ids, dtype=torch.long, device=device)


def uniform_groups(scores: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """Per row: whether its group's sequence scores are all equal (a group GRPO/RLOO learns nothing from).

    Args:
        scores: (batch,) one score per sequence.
        index: (batch,) numpy array of group ids (prompt uids).

    Returns:
        (batch,) bool.

    Example:
        >>> uniform_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), np.array(["a", "a", "b", "b"], dtype=object))
        tensor([ True,  True, False, False])
    """
    ids = group_ids(index, scores.shape[0], scores.device)
    return _uniform_per_group(scores, ids)[ids]


def _uniform_per_group(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(num_groups,) bool: whether the group's scores are all equal."""
    num_groups = int(ids.max()) + 1 if ids.numel() else 0
    high = torch.full((num_groups,), -torch.inf, dtype=scores.dtype).scatter_reduce(0, ids, scores, "amax")
    low = torch.full((num_groups,), torch.inf, dtype=scores.dtype).scatter_reduce(0, ids, scores, "amin")
    return high == low


def informative_rows(
    scores: torch.Tensor, index: np.ndarray, *, multiple_of: int = 1, min_rows: int = 1
) -> np.ndarray:
    """Indices of the rows whose group's scores differ (DAPO's filter, without resampling), in order.

    Uniform groups are put back, first ones first, until the rows number a multiple of
    ``multiple_of`` and at least ``min_rows`` (all rows when the batch has no more).

    Args:
        scores: (batch,) one score per sequence.
        index: (batch,) numpy array of group ids (prompt uids).
        multiple_of: e.g. the number of workers the rows are split over.
        min_rows: e.g. workers x mini-batches, so that no worker gets an empty mini-batch.

    Example:
        >>> scores, uid = torch.tensor([1.0, 1.0, 0.0, 1.0]), np.array(["a", "a", "b", "b"], dtype=object)
        >>> informative_rows(scores, uid).tolist(), informative_rows(scores, uid, min_rows=3).tolist()
        ([2, 3], [0, 1, 2, 3])
    """
    index = np.asarray(index, dtype=object)
    keep = ~uniform_groups(scores, index).cpu().numpy()
    for group in dict.fromkeys(index[~keep].tolist()):
        if keep.sum() % multiple_of == 0 and keep.sum() >= min_rows:
            break
        keep |= index == group
    return np.flatnonzero(keep)


def failed_group_rows(scores: torch.Tensor, index: np.ndarray) -> np.ndarray:
    """The first row of every group where no sample scored 1.0 (fully right), in order.

    Args:
        scores: (batch,) one score per sequence.
        index: (batch,) numpy array of group ids (prompt uids).

    Example:
        >>> scores = torch.tensor([0.0, 0.5, 1.0, 0.0, 0.0, 0.0])
        >>> failed_group_rows(scores, np.array(["a", "a", "b", "b", "c", "c"], dtype=object)).tolist()
        [0, 4]
    """
    ids = group_ids(index, scores.shape[0], scores.device)
    num_groups = int(ids.max()) + 1 if ids.numel() else 0
    best = torch.full((num_groups,), -torch.inf, dtype=scores.dtype).scatter_reduce(0, ids, scores, "amax")
    first = torch.full((num_groups,), scores.shape[0], dtype=torch.long)
    first = first.scatter_reduce(0, ids, torch.arange(scores.shape[0]), "amin")
    return first[best < 1.0].sort().values.numpy()


def pick_groups(scores: torch.Tensor, index: np.ndarray, num_groups: int) -> np.ndarray:
    """Row indices of ``num_groups`` whole groups: those whose scores differ first, then uniform ones.

    DAPO's dynamic sampling: of the groups sampled over several rounds, the update gets informative
    ones, in the order they came; uniform groups fill the batch only when too few scored unevenly.

    Args:
        scores: (batch,) one score per sequence.
        index: (batch,) numpy array of group ids (prompt uids); a group's rows need not be adjacent.
        num_groups: how many groups to keep (all of them if the batch has fewer).

    Example:
        >>> scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
        >>> pick_groups(scores, np.array(["a", "a", "b", "b", "c", "c"], dtype=object), 2).tolist()
        [2, 3, 4, 5]
    """
    index = np.asarray(index, dtype=object)
    uniform = uniform_groups(scores, index).cpu().numpy()
    groups = list(dict.fromkeys(index.tolist()))
    is_uniform = dict(zip(index.tolist(), uniform.tolist()))
    chosen = set(sorted(groups, key=lambda g: is_uniform[g])[:num_groups])  # stable: informative first
    return np.flatnonzero([uid in chosen for uid in index.tolist()])


def uniform_group_fraction(scores: torch.Tensor, index: np.ndarray) -> float:
    """Fraction of groups whose sequence scores are all equal: they carry no GRPO/RLOO signal.

    Args:
        scores: (batch,) one score per sequence.
        index: (batch,) numpy array of group ids (prompt uids).
    """
    uniform = _uniform_per_group(scores, group_ids(index, scores.shape[0], scores.device))
    return uniform.float().mean().item() if uniform.numel() else 0.0


# --- Loss aggregation and the value loss (policy losses: rl_extension.algorithms.policy_losses)

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Reduce a (batch, response_len) loss matrix to a scalar over the valid tokens.

    * "token-mean":          sum_{i,t} m_it L_it / sum_{i,t} m_it  (every token weighs the same)
    * "seq-mean-token-sum":  mean_i sum_t m_it L_it
    * "seq-mean-token-mean": mean_i (sum_t m_it L_it / sum_t m_it)
    The sequence means run over rows with at least one valid token; no valid token at all gives 0.

    Args:
        loss_mat: (batch, response_len) per-token losses.
        loss_mask: (batch, response_len); nonzero on tokens that count.
        loss_agg_mode: one of `LOSS_AGG_MODES`.

    Returns:
        A scalar tensor.

    Raises:
        ValueError: unknown mode.

    Example:
        >>> agg_loss(torch.tensor([[1.0, 3.0], [5.0, 0.0]]), torch.tensor([[1, 1], [1, 0]]),
        ...          "seq-mean-token-mean")
        tensor(3.5000)
    """
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        if loss_agg_mode == "seq-mean-token-sum":
            per_seq = masked_sum(loss_mat, loss_mask, dim=-1)
        else:
            per_seq = masked_mean(loss_mat, loss_mask, dim=-1)
        has_tokens = valid_mask(loss_mask).any(dim=-1)
        return masked_mean(per_seq, has_tokens)
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: the critic may not move further than `cliprange_value` per update.

    v_clip = clip(vpreds, values - c, values + c)
    L = 0.5 * max((vpreds - R)^2, (v_clip - R)^2), aggregated with `agg_loss`.

    Args:
        vpreds: (batch, response_len) current critic predictions (carry the gradient).
        returns: (batch, response_len) targets R.
        values: (batch, response_len) critic values at rollout time.
        response_mask: (batch, response_len); nonzero on real response tokens.
        cliprange_value: c.
        loss_agg_mode: see `agg_loss`.

    Returns:
        (vf_loss, vf_clipfrac): scalars; vf_clipfrac = fraction of valid tokens where the clipped
        term was the larger one.

    Example:
        >>> v = torch.tensor([[1.0]])
        >>> compute_value_loss(v, torch.tensor([[2.0]]), v, torch.ones(1, 1), 0.5)[0]
        tensor(0.5000)
    """
    valid = valid_mask(response_mask)
    zero = torch.zeros((), dtype=vpreds.dtype, device=vpreds.device)
    # Zeroed first so garbage at masked positions cannot turn the gradient into nan.
    vpreds, returns, values = (torch.where(valid, x, zero) for x in (vpreds, returns, values))
    vpreds_clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpreds_clipped - returns) ** 2
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    vf_loss = 0.5 * agg_loss(loss_mat, response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).to(vpreds.dtype), response_mask)
    return vf_loss, vf_clipfrac


# --- Logits → entropy and log-probs


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution over the last dimension.

    H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v, computed on z - max(z) so that huge
    logits lose no float precision.

    Args:
        logits: (..., vocab).

    Returns:
        (...) entropies, in nats.

    Example:
        >>> entropy_from_logits(torch.zeros(2))  # log 2
        tensor(0.6931)
    """
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(shifted, dim=-1)
    return torch.logsumexp(shifted, dim=-1) - (probs * shifted).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under the softmax of its logits.

    log p(y) = z_y - logsumexp(z). Never materialises the full log-softmax; rows are processed in
    chunks in float32, so a bf16 (tokens, vocab) tensor is never copied whole to float32.

    Args:
        logits: (..., vocab).
        labels: (...) integer token ids.

    Returns:
        (...) float32 log-probs; differentiable w.r.t. `logits`.

    Example:
        >>> logprobs_from_logits(torch.zeros(1, 4), torch.tensor([2]))  # log 1/4
        tensor([-1.3863])
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match logits shape "
            f"{tuple(logits.shape)} without its last (vocab) dimension"
        )
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1, 1)
    chunks = []
    for start in range(0, flat_logits.shape[0], _LOGPROB_CHUNK_ROWS):
        rows = flat_logits[start : start + _LOGPROB_CHUNK_ROWS].float()
        picked = rows.gather(-1, flat_labels[start : start + _LOGPROB_CHUNK_ROWS]).squeeze(-1)
        chunks.append(picked - torch.logsumexp(rows, dim=-1))
    if not chunks:
        return torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(chunks).reshape(labels.shape)
