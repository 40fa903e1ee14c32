"""Parallelism applied to a model-stage after it is built on ``meta``.

- ``parallelize``     TP (DTensor plans as data), FSDP2 over dp, the pipeline cut, and the stage's local buffers
- ``groups``          the one process-group registry: every TP/PP/DP group of every layout, released after a transition
- ``pipeline``        forward and forward + backward over micro-batches, with or without PP; gradient sync
- ``packing``         token-budget micro-batches: rows packed with their padding removed
- ``vocab_parallel``  log-probs and entropy from vocabulary-sharded logits
"""
