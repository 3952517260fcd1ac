"""Dynamic sampling (``algorithm.dynamic_sampling``): rounds of rollouts joined into one batch, and the
trainer refilling a step's batch with informative groups.

Run: python -m pytest tests/rl/test_sampling.py -q
"""

import numpy as np
import pytest
import torch

from rl_extension.config import PPOConfig, load_config
from rl_extension.metrics import read_jsonl
from rl_extension.roles.rollout import concat_rollouts, rollout_batch
from rl_extension.trainer import PPOTrainer
from spmdcall.data import DataProto

PAD, EOS = 0, 9
TINY_RUN = [  # a 2-layer, 64-wide model, 4 prompts x 4 samples a step, 2 steps
    "model.tiny.num_layers=2",
    "model.tiny.hidden_size=64",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=128",
    "data.synthetic.num_train=200",
    "data.synthetic.num_val=12",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=4",
    "trainer.total_steps=2",
    "trainer.val_every=2",
    "trainer.save_every=2",
    "trainer.loggers=[jsonl]",
    "trainer.progress=none",
]


def _rollout(prompts: list[list[int]], uid: list[str]) -> DataProto:
    """A generate output for left-padded prompts, each answered with [5, EOS]."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts]).unsqueeze(1)).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    data = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": positions},
        {"uid": np.array(uid, dtype=object)},
    )
    return rollout_batch(data, torch.tensor([[5, EOS, PAD]] * len(prompts)), [EOS])


def test_concat_rollouts_left_pads_the_narrower_prompts():
    narrow, wide = _rollout([[1, 2], [3]], ["a", "b"]), _rollout([[4, 5, 6, 7]], ["c"])
    joined = concat_rollouts([narrow, wide], PAD)
    assert joined.non_tensor_batch["uid"].tolist() == ["a", "b", "c"]
    assert joined.batch["input_ids"].tolist() == [
        [PAD, PAD, 1, 2, 5, EOS, PAD],
        [PAD, PAD, PAD, 3, 5, EOS, PAD],
        [4, 5, 6, 7, 5, EOS, PAD],
    ]
    assert joined.batch["attention_mask"][1].tolist() == [0, 0, 0, 1, 1, 1, 0]
    # Positions count real tokens, so padding more on the left changes none of them.
    assert joined.batch["position_ids"][0, 2:].tolist() == narrow.batch["position_ids"][0].tolist()
    assert joined.batch["prompts"][0].tolist() == [PAD, PAD, 1, 2]
    assert torch.equal(
        joined.batch["responses"], torch.cat([narrow.batch["responses"], wide.batch["responses"]])
    )
    assert narrow.batch["input_ids"].shape[1] == 5  # the inputs are left as they were
    assert concat_rollouts([wide], PAD) is wide


@pytest.mark.timeout(120)
def test_dynamic_sampling_samples_more_rounds_until_the_batch_is_full(tmp_path):
    # A random model answers nothing right, so every group is uniform: each step samples the most
    # rounds allowed and still keeps a full batch (uniform groups fill it).
    config = load_config(
        PPOConfig,
        "tiny-cpu",
        [
            f"trainer.run_dir={tmp_path / 'run'}",
            *TINY_RUN,
            "trainer.backend=inline",
            "trainer.num_workers=1",
            "algorithm.drop_uniform_groups=false",
            "algorithm.dynamic_sampling=true",
            "algorithm.max_sample_rounds=3",
        ],
    )
    with PPOTrainer(config) as trainer:
        trainer.fit()
        position = trainer.train_loader.state_dict()["position"]
    records = read_jsonl(trainer.run_dir / "metrics.jsonl")[1:]
    assert [r["sampling/rounds"] for r in records] == [3, 3]
    assert [r["sampling/informative_group_frac"] for r in records] == [0.0, 0.0]
    assert all(r["actor/update_row_frac"] == 1.0 for r in records)
    assert position == 6  # 2 steps x 3 prompt batches
