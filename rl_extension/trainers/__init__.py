"""The trainers and what they are made of.

- ``ppo``: ``PPOTrainer``, the single controller of a PPO/GRPO run (the loop);
- ``async_ppo``, ``async_rollout``: ``trainer.mode=async``, the rollout generating while the actor trains;
- ``sft``: ``SFTTrainer``, supervised fine-tuning (the warm start);
- ``checkpointing``, ``run_dir``: checkpoints, resuming and recovery;
- ``batch_transforms``: the batch recipes (guidance, dynamic sampling, demonstrations);
- ``metrics``: where a run's metrics go.
"""
