"""The RL algorithms: pure tensor maths over right-padded response tokens.

- ``advantages``  masked statistics, whitening, KL estimators (k1, k3), mini-batch order
- ``ppo``         GAE over KL-penalised token rewards, the clipped policy and value losses, the loss aggregation rule
- ``grpo``        group-relative advantages (GRPO, Dr. GRPO)
- ``registry``    ``algorithm(cfg)``: what the step asks of an algorithm (a critic?, advantages, the trained models' losses)
"""
