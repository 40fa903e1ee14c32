"""The baselines against brute force on a tiny case: the best static plan over every plan of the
pool (each priced step by step through the world, not the table), and the Viterbi oracle over
every sequence of a few plans over a few steps, the world's transitions counted."""

import dataclasses
import itertools
import math
import types

import numpy as np
import pytest
from nereus.trainer.controller.search import stage_candidates
from nereus.trainer.simulate import baselines as B
from nereus.trainer.simulate.inputs import SimulateError, load_cluster, load_job, load_world
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
    table = B.Table(exact=exact, trace=trace, restart_seconds=job.world.restart_seconds)
    table.add([cfg, *templates])
    return exact, trace, table


RESTART = 300.0  # the job's world.restart_seconds (inputs.py's default)


def _step(exact, cfg, t) -> float:
    """A step booked as the loop books it: over the memory, a restart and the step again."""
    _, seconds, oom = exact.step(cfg, t, peaks=False)
    return 2 * seconds + RESTART if oom else seconds


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
                total += min(exact.transition(x, x.plan, y.plan, 1)[0], RESTART)  # a live move or a restart
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


class _Table(B.Table):
    """A pure table: seconds, feasibility and live moves given (no world)."""

    def __init__(self, trace, raw, feasible, moves, restart):
        super().__init__(exact=None, trace=trace, restart_seconds=restart, name="pure")
        self.raw, self.feasible, self._given = np.array(raw, dtype=float), np.array(feasible, dtype=bool), moves
        self.scaled = [{t.devices: types.SimpleNamespace(nproc=t.devices) for t in trace} for _ in raw]

    def transition(self, i, j, a, b, step=0):
        return 0.0 if (i == j and a == b) else self._given[(i, j, a, b)]

    def fits(self, i, j, a, b):  # every live move within the memory (the world's check: test_a_live_move_over_the_memory_...)
        return True


def _pure(seed=0):
    rng = np.random.default_rng(seed)
    devices = [0, 16, 16, 8, 8, 2, 16, 16, 2]  # step 1 waits at no pace; 6 and 9 no template runs (waited at the pace)
    trace = [TraceStep(step=i + 1, devices=d, response_max=10, response_mean=5.0, failed=i == 6) for i, d in enumerate(devices)]
    k = 4
    raw = rng.uniform(5, 20, (k, len(trace)))
    raw[:, [0, 5, 8]] = np.inf
    raw[3, 3] = np.inf  # template 3 holds no replica on step 4
    feasible = rng.uniform(size=raw.shape) > 0.3  # infeasible cells: a restart and the step again
    for s in (1, 2, 3, 4, 6, 7):  # every runnable step: some template within the memory
        feasible[s % 3, s] = True
    moves = {(i, j, a, b): float(rng.choice([rng.uniform(0, 8), rng.uniform(40, 90)]))
             for i in range(k) for j in range(k) for a in (16, 8) for b in (16, 8)}
    return _Table(trace, raw, feasible, moves, restart=30.0)


def _brute(table, seq) -> float:
    """A sequence's time from the primitives: the loop's booking (module docstrings)."""
    runs = [s for s in range(len(table.trace)) if (np.isfinite(table.raw[:, s]) & table.feasible[:, s]).any()]
    total, pace, prev = 0.0, 0.0, None
    for s, t in enumerate(table.trace):
        if s not in runs:
            total += pace
            continue
        k = seq[runs.index(s)]
        raw = table.raw[k, s]
        total += raw + ((raw + table.restart_seconds) if (not table.feasible[k, s] or t.failed) else 0.0)
        if prev is not None:
            (pk, pd) = prev
            if (pk, pd) != (k, t.devices):
                total += min(table.transition(pk, k, pd, t.devices), table.restart_seconds)
        pace, prev = raw, (k, t.devices)
    return total


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_oracle_is_exact_on_a_table_with_infeasible_cells_waits_and_device_changes(seed):
    table = _pure(seed)
    assert not table.feasible[:, [1, 2, 3, 4, 6, 7]].all() and len(set(table.devices.tolist())) == 4
    ks = [0, 1, 2, 3]
    best = min(_brute(table, seq) for seq in itertools.product(ks, repeat=6) if np.isfinite(_brute(table, seq)))
    path = B.path_of(table, "oracle", B.viterbi(table, ks))
    assert path.total == pytest.approx(best, rel=1e-12)
    assert path.total == pytest.approx(_brute(table, [p for p in path.picks if p >= 0]), rel=1e-12)
    # waits at the pace of the step before them (none before the first step ran)
    assert path.wait_seconds[0] == 0 and path.wait_seconds[5] == path.step_seconds[4] > 0 and path.wait_seconds[8] == path.step_seconds[7]
    # restarts: every infeasible pick and the failed step 7, each the step again
    assert set(path.restarts) == {s for s in range(9) if path.picks[s] >= 0 and (not table.feasible[path.picks[s], s] or s == 6)}
    for k in range(3):  # every static plan (3 has no replica on step 4) and greedy: none beats the oracle
        assert path.total <= B.static_total(table, k) * (1 + 1e-12)
        assert B.static_total(table, k) == pytest.approx(_brute(table, [k] * 6), rel=1e-12)
    assert B.static_total(table, 3) == math.inf and B.best_static(table) == min(range(3), key=lambda k: _brute(table, [k] * 6))
    assert path.total <= B.path_of(table, "greedy", B.greedy(table, ks)).total * (1 + 1e-12)


def test_a_move_is_the_cheaper_of_the_live_move_and_a_restart():
    table = _pure(0)
    table._given[(0, 1, 16, 16)] = 500.0
    table._given[(1, 0, 16, 16)] = 2.0
    assert table.move(0, 1, 16, 16) == 30.0 and table.move_kind(0, 1, 16, 16) == "restart"
    assert table.move(1, 0, 16, 16) == 2.0 and table.move(2, 2, 16, 16) == 0.0


def test_a_table_no_plan_runs_is_a_one_line_error():
    table = _pure(0)
    table.raw[:] = np.inf
    for fn in (B.best_static, B.free_moves, lambda t: B.viterbi(t, [0, 1]), lambda t: B.path_of(t, "x", [])):
        with pytest.raises(SimulateError, match=r"^trace 'pure': no plan of the pool runs any of its 9 steps within the memory \(devices 0, 2, 8, 16\)$"):
            fn(table)
    with pytest.raises(SimulateError, match="restart_seconds must be >= 0"):
        _Table(table.trace, table.raw, table.feasible, {}, restart=-1.0)


def test_path_of_wants_one_plan_per_runnable_step():
    with pytest.raises(SimulateError, match="x: 2 plans for the trace's 6 runnable steps"):
        B.path_of(_pure(0), "x", [0, 0])


def test_the_move_cache_keys_on_the_step_in_a_noisy_world(tiny):
    exact, trace, table = tiny
    noisy = type(exact)(exact.params, seed=exact.seed, prompt_mean=exact.prompt_mean, noise=True)
    t = B.Table(exact=noisy, trace=trace, restart_seconds=1e9)
    t.add(table.templates[:2])
    x, y = t.templates
    seconds = [t.move(0, 1, 16, 16, s) for s in (1, 2, 3)]
    assert seconds == [noisy.transition(x, x.plan, y.plan, s)[0] for s in (1, 2, 3)] and len(set(seconds)) == 3


def test_a_live_move_over_the_worlds_memory_is_priced_as_a_restart(tiny):
    """A table move the world's memory cannot hold stage by stage (``World.move_fits``) costs a
    restart, as the loop's moves are checked, however cheap its transfer."""
    exact, trace, table = tiny
    pairs = [(i, j, a) for i in range(len(table.scaled)) for j in range(len(table.scaled)) if i != j
             for a in table.scaled[i] if a in table.scaled[j]]
    live = [(i, j, a) for i, j, a in pairs if table.fits(i, j, a, a) and 0 < table.transition(i, j, a, a) < table.restart_seconds]
    assert live  # some moves of the 8B pool on 16 devices fit and cost less than a restart
    i, j, a = live[0]
    assert table.move(i, j, a, a) == table.transition(i, j, a, a) and table.move_kind(i, j, a, a) == "transition"
    table._fits[(i, j, a, a)] = False  # as the world answers where a rank cannot hold the move
    try:
        assert table.move(i, j, a, a) == table.restart_seconds and table.move_kind(i, j, a, a) == "restart"
    finally:
        table._fits[(i, j, a, a)] = True

