"""``nereus simulate``: the controller at 64–4,096 devices, trace-driven, through the code that runs live.

- ``inputs``   the typed YAML inputs: cluster (and its world), job (HF model shapes); their validation
- ``traces``   per-step lengths and devices: seeded generators, JSONL traces, a real run's records
- ``world``    the ground truth, a model of its own: step times, peaks and transitions the controller must learn
- ``policies`` the loop's: adaptive (the live ``Controller``), controller_greedy
- ``baselines`` in hindsight on the world: best_static, initial_fixed, oracle (Viterbi), greedy
- ``calibration`` the controller's calibrated error on unseen plans
- ``replay``   a real run's measured pieces replayed against the world's (``live_error``)
- ``run``      every policy through one trace in one world
- ``outputs``  Markdown and JSON summaries, PNG plots

The controller's models, search and admission are imported from ``trainer/controller``,
never copied: the adaptive policy calls ``Controller.observe``/``decide``/``transitioned``
with the step loop's metrics, as ``trainer/runtime/worker.py`` does.
"""
