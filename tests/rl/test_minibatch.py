"""The update loop the actor and the critic share (rl_extension/roles/minibatch.py), on a linear model.

Run: python -m pytest tests/rl/test_minibatch.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl_extension.roles.minibatch import update_in_mini_batches
from spmdcall.data import DataProto


def rows(n: int, bad: set[int] = frozenset()) -> DataProto:
    return DataProto.from_dict(
        {"row": torch.arange(n), "x": torch.ones(n, 2), "bad": torch.tensor([i in bad for i in range(n)])}
    )


def test_epochs_mini_batches_and_micro_batches():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen, weights, orders = [], [], []

    def micro_step(micro: DataProto, weight: float) -> dict[str, float]:
        seen.append(micro.batch["row"].tolist())
        weights.append(weight)
        (model(micro.batch["x"]).sum() * weight).backward()
        return {"test/rows": float(len(micro))}

    metrics = update_in_mini_batches(
        model,
        optimizer,
        rows(8),
        micro_step,
        num_epochs=3,
        num_mini_batches=2,
        micro_batch_size=3,
        grad_clip=1.0,
        rng=np.random.default_rng(0),
        prefix="test",
        between_epochs=orders.append,
    )
    assert len(orders) == 2  # after every epoch but the last
    assert all(sorted(order) == list(range(8)) for order in orders) and orders[0].tolist() != list(range(8))
    # each epoch: 2 mini-batches of 4 rows, each as micro-batches of 3 + 1 rows weighted by their share
    assert [len(s) for s in seen] == [3, 1] * 6 and weights == [0.75, 0.25] * 6
    assert [r for s in seen[:4] for r in s] == orders[0].tolist()
    assert metrics["test/rows"] == 2.0 and metrics["test/grad_norm"] > 0
    assert "test/skipped_steps" not in metrics


@pytest.mark.parametrize("prefix", ["actor", "critic"])
def test_a_step_with_a_non_finite_gradient_norm_is_skipped_and_counted(prefix):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    after_step: list[torch.Tensor] = []

    def micro_step(micro: DataProto, weight: float) -> dict[str, float]:
        after_step.append(model.weight.detach().clone())
        loss = model(micro.batch["x"]).sum() * weight
        (loss * float("nan") if micro.batch["bad"].any() else loss).backward()
        return {}

    metrics = update_in_mini_batches(
        model,
        optimizer,
        rows(8, bad={4, 6}),
        micro_step,
        num_epochs=1,
        num_mini_batches=4,  # rows 4-5 and 6-7 are bad: two of four steps skipped
        micro_batch_size=2,
        grad_clip=1.0,
        rng=None,
        prefix=prefix,
    )
    assert metrics[f"{prefix}/skipped_steps"] == 2.0
    assert not torch.equal(after_step[0], after_step[1])  # a good step moved the weights
    assert torch.equal(after_step[2], model.weight) and torch.isfinite(model.weight).all()  # bad: no change
