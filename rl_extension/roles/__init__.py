"""One class per role of a PPO/GRPO run; the trainer fuses the ones sharing processes with ``sc.colocate``.

- ``Actor``: the FSDP2 policy (log-probs, PPO updates, checkpoints).
- ``HFRollout``, ``VLLMRollout`` (``ROLLOUTS[rollout.name]``): sample responses; take the colocated actor's weights.
- ``Reference``: log-probs under the frozen starting policy.
- ``Critic``: the FSDP2 value model (GAE).
- ``RewardModel``: a sequence-classification model that scores responses.
"""

from rl_extension.roles.actor import Actor
from rl_extension.roles.critic import Critic
from rl_extension.roles.ref import Reference
from rl_extension.roles.reward_model import RewardModel
from rl_extension.roles.rollout import ROLLOUTS, HFRollout
from rl_extension.roles.vllm_rollout import VLLMRollout  # registers ROLLOUTS["vllm"]; vllm loads lazily

__all__ = ["Actor", "Critic", "HFRollout", "ROLLOUTS", "Reference", "RewardModel", "VLLMRollout"]
