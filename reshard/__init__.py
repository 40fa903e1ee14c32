"""Resharding: move a model-stage's distributed state from one sharded layout to another.

Pure planning (no process group, no I/O):

- :mod:`.layout` — tensor layouts, parallel configs, EMUs, JSON;
- :mod:`.derive` — EMUs of a Llama/Qwen2 decoder under a (dp, tp, pp) config;
- :mod:`.plan` — the exact overlap plan (DCP ReadItems with a sender and a receiver);
- :mod:`.estimate` / :mod:`.arrays` — the same transfers as numpy columns, at scale;
- :mod:`.graph` — the transition graph: rounds, memory budget, alpha-beta time;
- :mod:`.links` — the alpha-beta cost of a message per link class, and its calibration.

Execution (the only modules that move bytes):

- :mod:`.stream` — point-to-point between live ranks: the front door, built from
  :mod:`.messages` (which transfers travel together, pure), :mod:`.agreement` (every
  rank's verdict and the plan's fingerprint, before and after), :mod:`.rounds` (the round
  engine and its staging arena) and :mod:`.transport` (gloo's or NCCL's semantics, from
  the process group; the transition's one deadline);
- :mod:`.staged` — the memory-staged checkpoint: its format and its save; :mod:`.staged_load`
  loads it through DCP, reading each box in bounded ranged pieces (:mod:`.pieces`);
- :mod:`.execute` — one front door mixing both, and the budget fallback;
- :mod:`.gather` — a distributed state's full tensors on one rank, every replica checked
  (tests and checks on small models);
- :mod:`.checksum` — CRC32C block checksums, shared with the store.

:mod:`.reference` builds deterministic tensors to check every element of a reshard;
:mod:`.demo` (``nereus demo``) moves a live actor state through an RL job's layouts on 4
processes; :mod:`.errors` holds the errors, each naming the tensor, rank or layout at fault.
"""
