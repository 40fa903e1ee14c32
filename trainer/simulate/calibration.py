"""The controller's calibrated error on plans it has not run, on the world (pure).

``unseen_error``: the 8B PPO job on 1,024 MI250X GCDs over the drift trace's lengths; the
candidate pool (``baselines.pool``) ordered by a seeded shuffle; the controller's step-time
model (``StepTimeModel.for_profile(...).calibrate``, its own least squares) calibrated on
every measured piece (the noisy world) of the first ``seen`` plans at ``lengths`` steps of
the trace, then its predicted step seconds (Σ pieces) of the next ``unseen`` plans at the
same steps against the world's noise-free seconds: per plan the mean relative error over
the steps; ``mean`` and ``max`` over the unseen plans (the paper: 4.96%, 14.61% on 72).
"""

from __future__ import annotations

import numpy as np

from ..controller.pieces import piece_features
from ..controller.steptime import Placement, StepTimeModel
from . import baselines as B
from .inputs import load_cluster, load_job, load_world
from .traces import generate, load_trace_spec
from .world import pieces


def unseen_error(sim_dir, *, steps: int = 1000, seen: int = 8, unseen: int = 72, lengths: int = 6, seed: int = 0) -> dict:
    from .run import initial_config

    cluster, job = load_cluster(sim_dir / "clusters" / "mi250x_1024.yaml"), load_job(sim_dir / "jobs" / "llama3_8b_ppo.yaml")
    trace = generate(load_trace_spec(sim_dir / "traces" / "drift.yaml"), rows=job.rows, cap=job.response.max, devices=cluster.devices,
                     per_node=cluster.per_node)[:steps]
    world, exact = load_world(cluster, job), load_world(cluster, job, noise=False)
    profile = cluster.profile()
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        from .inputs import write_profile

        cfg = initial_config(cluster, job, trace, write_profile(profile, os.path.join(tmp, "p.yaml")), memory_gib=world.params.memory_gib)
    plans = B.pool(cfg, trace, profile, prompt_mean=job.prompt.mean, memory_gib=world.params.memory_gib)
    order = np.random.default_rng(seed).permutation(len(plans))
    plans = [plans[i] for i in order[: seen + unseen]]
    at = [trace[i] for i in np.linspace(0, len(trace) - 1, lengths).astype(int)]
    where = Placement(nproc=cfg.nproc, profile=profile)
    samples = []
    for c in plans[:seen]:
        for t in at:
            metrics, _, _ = world.step(c, t, peaks=False)
            work = B.workload(c, t, job.prompt.mean)
            for name, rec in metrics["stages"].items():
                f = piece_features(c, name, work, where)
                if f is not None:
                    samples.append((f, rec["seconds"]))
    model = StepTimeModel.for_profile(profile).calibrate(samples)
    errors = []
    for c in plans[seen:]:
        per = []
        for t in at:
            work = B.workload(c, t, job.prompt.mean)
            pred = sum(float(model.predict(piece_features(c, name, work, where))) for name in pieces(c)
                       if piece_features(c, name, work, where) is not None)
            real = exact.step(c, t, peaks=False)[1]
            per.append(abs(pred - real) / real)
        errors.append(float(np.mean(per)))
    return {"mean": float(np.mean(errors)), "max": float(np.max(errors)), "seen": seen, "unseen": len(errors), "steps_at": [t.step for t in at]}
