"""Resharding: move a model-stage's distributed state from one sharded layout to another.

Pure planning (no process group, no I/O):

- :mod:`.layout` — tensor layouts, parallel configs, EMUs, JSON;
- :mod:`.derive` — EMUs of a Llama/Qwen2 decoder under a (dp, tp, pp) config;
- :mod:`.plan` — the exact overlap plan (DCP ReadItems with a sender and a receiver);
- :mod:`.estimate` / :mod:`.arrays` — the same transfers as numpy columns, at scale;
- :mod:`.graph` — the transition graph: rounds, memory budget, alpha-beta time.

Execution (the only modules that move bytes):

- :mod:`.stream` — point-to-point between live ranks: the front door, built from
  :mod:`.messages` (which transfers travel together, pure), :mod:`.agreement` (every
  rank's verdict and the plan's fingerprint, before and after), :mod:`.rounds` (the round
  engine and its staging arena) and :mod:`.transport` (gloo's or NCCL's semantics, from
  the process group; the transition's one deadline);
- :mod:`.staged` — through a memory-staged checkpoint, loaded with DCP;
- :mod:`.execute` — one front door mixing both, and the budget fallback;
- :mod:`.checksum` — CRC32C block checksums, shared with the store.

:mod:`.reference` builds deterministic tensors to check every element of a reshard.
"""
