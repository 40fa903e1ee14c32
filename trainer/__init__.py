"""Models, parallelization, rollout, PPO/GRPO and the controller: placeholder, filled by a later issue."""
