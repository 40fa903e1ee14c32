"""The baselines against brute force on a tiny case: the best static plan over every plan of the
pool (each priced step by step through the world, not the table), and the Viterbi oracle over
every sequence of a few plans over a few steps, the world's transitions counted."""

import dataclasses
import itertools
import math

import numpy as np
import pytest
from nereus.trainer.controller.search import stage_candidates
from nereus.trainer.simulate import baselines as B
from nereus.trainer.simulate.inputs import load_cluster, load_job, load_world
from nereus.trainer.simulate.run import initial_config
from nereus.trainer.simulate.traces import TraceStep

CLUSTER = {"name": "tiny-16", "device": "mi250x", "nodes": 2}
JOB = {"name": "tiny-8b", "model": "llama-3.1-8b", "prompts_per_step": 16, "samples_per_prompt": 4, "minibatch_size": 32,
       "prompt": {"mean": 256, "max": 512}, "response": {"max": 8192, "mean": 1024}}
LENGTHS = [(600, 400.0), (8000, 5000.0), (1200, 700.0), (7000, 4000.0)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cluster, job = load_cluster(CLUSTER), load_job(JOB)
    trace = [TraceStep(step=i + 1, devices=16, response_max=m, response_mean=u) for i, (m, u) in enumerate(LENGTHS)]
    exact = load_world(cluster, job, noise=False)
    cfg = initial_config(cluster, job, trace, "mi250x", memory_gib=exact.params.memory_gib)
    templates = B.pool(cfg, trace, cluster.profile(), prompt_mean=job.prompt.mean, top=8, beam=16, memory_gib=exact.params.memory_gib)
    table = B.Table(exact=exact, trace=trace)
    table.add([cfg, *templates])
    return exact, trace, table


def _step(exact, cfg, t) -> float:
    _, seconds, oom = exact.step(cfg, t, peaks=False)
    return math.inf if oom else seconds


def test_best_static_is_the_best_of_every_plan_priced_step_by_step(tiny):
    exact, trace, table = tiny
    assert len(table.templates) >= 8
    totals = [sum(_step(exact, c, t) for t in trace) for c in table.templates]
    best = B.best_static(table)
    assert best is not None and math.isfinite(totals[best])
    assert totals[best] == pytest.approx(min(totals), rel=1e-9)
    assert B.static_total(table, best) == pytest.approx(min(totals), rel=1e-9)


def test_refined_best_static_beats_every_one_stage_change_priced_step_by_step(tiny):
    """``refine``'s plan is the best of the grown pool, and no plan one model-stage away from
    it (every candidate of the search's space for that stage, no beam) is faster on the world."""
    exact, trace, table = tiny
    before = B.static_total(table, B.best_static(table))
    best = B.refine(table, [B.best_static(table)], prompt_mean=256.0)
    cfg = table.templates[best]
    total = sum(_step(exact, cfg, t) for t in trace)
    assert total <= before * (1 + 1e-12) and total == pytest.approx(B.static_total(table, best), rel=1e-9)
    assert B.best_static(table) == best
    tried = 0
    for key, sc in cfg.plan.stages().items():
        ranks = tuple(sc.ranks or range(cfg.nproc))
        options = dict.fromkeys(o for t in trace for o in stage_candidates(cfg, key, ranks, B.workload(cfg, t, 256.0)).configs())
        for other in options:
            alt = dataclasses.replace(cfg, plan=B.replace_stage(cfg.plan, key, other))
            tried += 1
            assert sum(_step(exact, alt, u) for u in trace) >= total * (1 - 1e-9), (key, other)
    assert tried > 500


def test_the_oracle_is_exact_against_every_sequence_and_bounds_every_policy(tiny):
    exact, trace, table = tiny
    cost = table.cost
    ks = B.oracle_set(table, [B.best_static(table)], size=5)[:5]  # the best static plan, the steps' fastest, then the fastest
    assert len(ks) >= 2
    best = math.inf
    for seq in itertools.product(ks, repeat=len(trace)):
        total = sum(_step(exact, table.templates[k], t) for k, t in zip(seq, trace))
        for a, b in itertools.pairwise(seq):
            if a != b:
                x, y = table.templates[a], table.templates[b]
                total += exact.transition(x, x.plan, y.plan, 1)[0]
        best = min(best, total)
    picks = B.viterbi(table, ks)
    path = B.path_of(table, "oracle", picks)
    assert math.isfinite(best) and path.total == pytest.approx(best, rel=1e-9)
    for k in ks:  # every static plan of the set, and greedy's sequence
        if np.isfinite(cost[k]).all():
            assert path.total <= B.path_of(table, "static", [k] * len(trace)).total * (1 + 1e-12)
    assert path.total <= B.path_of(table, "greedy", B.greedy(table, ks)).total * (1 + 1e-12)


def test_scaling_keeps_tp_and_pp_and_fails_without_a_replica(tiny):
    _, _, table = tiny
    cfg = next(c for c in table.templates if any(sc.tp * sc.pp > 1 for sc in c.plan.stages().values()))
    half = B.scale(cfg, 8)
    if half is not None:
        for (k, a), b in zip(cfg.plan.stages().items(), half.plan.stages().values()):
            assert (a.tp, a.pp) == (b.tp, b.pp), k
    assert B.scale(dataclasses.replace(cfg), 0) is None
