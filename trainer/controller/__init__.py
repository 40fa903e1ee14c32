"""The controller: the plan follows the job (pure models, search and admission; no process group).

- ``profiles``   device profiles as data (FLOP/s, memory, links per class)
- ``memory``     per-rank memory of a plan at a sequence length, and the budget check
- ``workload``   what the coming step asks of each model-stage (rows, tokens, lengths)
- ``candidates`` a model-stage's candidate stage configs as arrays, and their micro-batching
- ``steptime``   per-model-stage step time from operation counts, calibrated online
- ``transition`` the cost of moving state between two plans (reshard's estimator and graph)
- ``search``     the best plans under the memory budget: frontier per model-stage, combined
- ``admission``  when to replan and whether a better plan pays for its transition
- ``classes``    the memory classes of ranks, and the offset fitted per class (``fit_memory``)
- ``evidence``   what was measured of the step time: the fit's rows, per-layout corrections and bands
- ``pieces``     a step's measured pieces as the models see them (features, owner), plans as keys
- ``online``     the live controller: observe → decide (trials of layouts not run yet), with its logs
- ``report``     what ``nereus plan`` prints: the search's plans as a table or JSON

The step loop (``trainer/runtime/control.py``'s ``JobControl``) calls it through one seam: ``observe`` after a step,
``decide`` before the next; ``nereus plan`` and the simulator call the same functions.
"""
