"""The trainer: ``nereus train`` and everything it runs, in rooms a change can be found by.

- ``config/``     the job config: typed tree, YAML loader, the checks the tree alone can make (no torch)
- ``prepare.py``  YAML to a runnable job: HF directories, vocabulary, ``plan: auto``, cross-room checks, devices
- ``seeds.py``    every seed the job derives (by step, row, parameter, epoch; never by rank)
- ``models/``     the decoder (no parallelism inside) and each model-stage's model arguments
- ``parallel/``   TP/FSDP2/PP applied to a stage, the process-group registry, pipelining, packing, vocab-parallel maths
- ``algos/``      PPO and GRPO behind one registry: advantages and losses, never ``if algorithm == ...``
- ``rollout/``    the rollout engines (built-in generator, vLLM) and the plan rules of each
- ``data/``       toy tasks, prompt datasets and sources, rule rewards, tokenizers
- ``metrics/``    per-piece meters, tensor memory traces, the metrics log, trackers, ``nereus report``
- ``controller/`` pure models (memory, step time, transitions), search and admission, the live controller
- ``simulate/``   ``nereus simulate``: traces, policies, the world the controller is judged on
- ``elastic/``    per-step staging, the choice of restore source, the run's lineage, resume, the job record
- ``runtime/``    the step (``Trainer``), model-stages, weight syncs and plan transitions, checkpoints,
                  the controller's seam and the worker loop

Dependencies run one way: ``config`` is the ground floor; ``controller`` and ``simulate`` never
import ``runtime``, ``elastic`` or ``torch.distributed``; ``elastic`` receives the trainer as an
argument (``docs/architecture.md``; ``.importlinter`` holds the rules).
"""
