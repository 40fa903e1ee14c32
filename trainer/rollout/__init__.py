"""Rollout: what ``actor.gen`` samples responses with.

- ``engine``       the ``RolloutEngine`` protocol and the plan rules of each engine, in one place
- ``generator``    the built-in engine: batched sampling with a KV cache, keyed by row (the same at any dp)
- ``vllm_engine``  vLLM in-process beside the trainer, its fused buffers written in place by the weight sync
- ``vllm_layout``  vLLM's layout rules (pure): its parameter names, padded vocabulary rows, plan checks (CPU too), EMUs
- ``vllm_install`` whether vLLM is installed and recent enough (without importing it), and its import
"""
