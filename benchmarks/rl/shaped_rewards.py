"""A denser reward for the addition demo, for the ablation of docs/rl/experiment-log.md only.

The demo's reward is 1 for the exact sum and 0 otherwise: a group of two samples carries a signal only
when one is right and the other wrong. ``digit_credit`` also scores a wrong answer by the digit places it
got right, so that two wrong samples differ and the update can tell which digits to keep: an
experiment on credit assignment, not the demo's recipe (the same verifier information, read finer).

    python benchmarks/rl/demo_seeds.py --seeds 0 reward.scorer=benchmarks/rl/shaped_rewards.py:digit_credit
"""

from __future__ import annotations


def digit_credit(response: str, ground_truth: str) -> float:
    """1.0 for the exact answer; a wrong number gets 0.9 x the share of its digit places that are right
    (ones aligned with ones), anything else 0. Only the exact answer scores 1.0, so accuracy is unchanged.

    Example:
        >>> digit_credit("1282", "1282"), digit_credit("1283", "1282"), digit_credit("282", "1282")
        (1.0, 0.675, 0.675)
        >>> digit_credit("12 82", "1282"), digit_credit("", "1282")
        (0.0, 0.0)
    """
    said, want = " ".join(response.split()), ground_truth.strip()
    if said == want:
        return 1.0
    if not said.isdigit():
        return 0.0
    right = sum(a == b for a, b in zip(reversed(said), reversed(want)))
    return 0.9 * right / max(len(said), len(want))
