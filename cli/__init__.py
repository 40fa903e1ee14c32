"""The ``nereus`` command (Typer): thin wrappers that parse, validate and call library code.

- ``app``       the Typer app: every command registered, one line each
- ``train``     ``nereus train``: a PPO/GRPO job, on its own workers or as one under torchrun
- ``resume``    ``nereus resume``: a stopped or crashed job continued on any number of processes
- ``plan``      ``nereus plan``: the best plans for a job and a world, offline
- ``simulate``  ``nereus simulate``: the controller on a cluster and a trace, in the simulated world
- ``convert``   ``nereus convert``: HF safetensors <-> Nereus checkpoints, offline
- ``inspect``   ``nereus inspect``: a checkpoint's manifest, EMUs and layouts
- ``report``    ``nereus report``: plots and a Markdown summary of a run directory
- ``configs``   ``nereus configs``: the shipped job configs, and the config reference
- ``demo``      ``nereus demo``: a live actor state resharded through an RL job's layouts
"""
