"""What a job measures and where it goes.

- ``meters``    per-piece seconds and peak memory of one step (``StageMeter``), process RSS, heap trimming
- ``memtrace``  the tensor memory a piece of code really allocates at its peak (CPU or CUDA)
- ``log``       ``RUN_DIR/metrics.jsonl``, one JSON object per step, and the trackers it feeds
- ``trackers``  console, TensorBoard, wandb, MLflow (rank 0)
- ``report``    ``nereus report RUN_DIR``: plots and a Markdown summary of a run
- ``probes``    opt-in reference probes (a fixed GEMM, eager ops, an all-reduce): the machine's load per step
"""
