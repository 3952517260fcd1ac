"""The batch columns each role method reads, defined once: the roles select them, the trainer sends them.

Only the tensors a call needs travel to the workers, so the trainer picks these columns out of the
step's batch before each call.
"""

from __future__ import annotations

__all__ = ["ACTOR_UPDATE_KEYS", "CRITIC_UPDATE_KEYS", "FORWARD_KEYS", "SCORE_KEYS"]

FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
"""A forward pass over prompt + response: log-probs of the actor and the reference."""

SCORE_KEYS = FORWARD_KEYS + ("response_mask",)
"""A forward pass whose output is masked to the response: the critic's values, the reward model's scores."""

CRITIC_UPDATE_KEYS = SCORE_KEYS + ("values", "returns")
"""The critic's value-loss update."""

ACTOR_UPDATE_KEYS = SCORE_KEYS + ("advantages",)
"""The actor's policy update; ``old_log_prob`` and ``ref_log_prob`` come along when the run has them."""
