"""The update loop the actor and the critic share: epochs -> mini-batches -> micro-batches.

Each epoch takes this rank's rows in a (seeded) shuffled order and cuts them into
``num_mini_batches`` mini-batches, one optimizer step each; a mini-batch is cut into micro-batches
whose gradients accumulate, each weighted by its share of the mini-batch's rows. What one
micro-batch computes (its loss and metrics) is the role's business: the ``micro_step`` it passes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from rl_extension import fsdp
from spmdcall.data import DataProto

__all__ = ["update_in_mini_batches"]


def update_in_mini_batches(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: DataProto,
    micro_step: Callable[[DataProto, float], dict[str, float]],
    *,
    num_epochs: int,
    num_mini_batches: int,
    micro_batch_size: int,
    grad_clip: float,
    rng: np.random.Generator | None,
    prefix: str,
    between_epochs: Callable[[np.ndarray], None] | None = None,
) -> dict[str, float]:
    """Train on ``data`` for ``num_epochs`` passes; return the mean of every metric (the largest
    value of one whose name ends in ``_max``).

    Args:
        model: the (sharded) model the optimizer steps.
        optimizer: stepped once per mini-batch, unless the gradient norm is not finite.
        data: this rank's rows, already on the model's device.
        micro_step: ``micro_step(micro, weight)`` runs the forward and ``(loss * weight).backward()``
            of one micro-batch and returns its metrics.
        num_epochs: passes over ``data``.
        num_mini_batches: optimizer steps per pass.
        micro_batch_size: rows per forward/backward.
        grad_clip: clip the global gradient norm to this; 0 only measures it.
        rng: shuffles the rows of every epoch; None keeps their order.
        prefix: names the loop's own metrics: ``{prefix}/grad_norm`` (mean over steps) and, when a
            step was skipped for a non-finite gradient norm, ``{prefix}/skipped_steps`` (a count).
        between_epochs: called after every epoch but the last with that epoch's row order.

    Example:
        >>> metrics = update_in_mini_batches(model, opt, data, step, num_epochs=1, num_mini_batches=2,
        ...     micro_batch_size=4, grad_clip=1.0, rng=None, prefix="critic")  # doctest: +SKIP
    """
    values: dict[str, list[float]] = defaultdict(list)  # every metric's values, in order
    skipped = 0
    for epoch in range(num_epochs):
        order = rng.permutation(len(data)) if rng is not None else np.arange(len(data))
        for mini in data.select_idxs(order).chunk(num_mini_batches):
            for micro in mini.split(micro_batch_size):
                for name, value in micro_step(micro, len(micro) / len(mini)).items():
                    values[name].append(value)
            grad_norm = fsdp.clip_grad_norm(model, grad_clip)
            if np.isfinite(grad_norm):
                optimizer.step()
            else:  # one bad batch must not destroy the weights; skip it and say so
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            values[f"{prefix}/grad_norm"].append(grad_norm)
        if between_epochs is not None and epoch + 1 < num_epochs:
            between_epochs(order)
    metrics = {name: max(v) if name.endswith("_max") else sum(v) / len(v) for name, v in values.items()}
    if skipped:
        metrics[f"{prefix}/skipped_steps"] = float(skipped)
    return metrics
