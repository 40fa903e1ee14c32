"""``nereus simulate``: the controller at 64–4,096 devices, trace-driven, through the code that runs live.

- ``inputs``   the typed YAML inputs: cluster, job (HF model shapes), truth; their validation
- ``traces``   per-step lengths and devices: seeded generators, JSONL traces, a real run's records
- ``truth``    the hidden ground truth: step times, peaks and transitions the controller must learn
- ``policies`` fixed (the paper's baseline), adaptive (the live ``Controller``), greedy, oracle
- ``run``      the loop: every policy through one trace on one truth
- ``outputs``  Markdown and JSON summaries, PNG plots

The controller's models, search and admission are imported from ``trainer/controller``,
never copied: the adaptive policy calls ``Controller.observe``/``decide``/``transitioned``
with the step loop's metrics, as ``trainer/runtime/worker.py`` does.
"""
