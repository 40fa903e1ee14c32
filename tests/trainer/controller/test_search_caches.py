"""The search's caches and shortcuts give what computing afresh gives: terms kept with a stage's
candidates (``Candidates.derived``) at another width, workload or job; the rank groups kept per
placement; the calibration's rows kept beside the samples; the class registry shared by
searches; and ``_extend``'s pruning of the fastest rows first."""

from __future__ import annotations

import dataclasses
import random
from collections import deque

import numpy as np
import pytest

from nereus.trainer.prepare import load_config
from nereus.trainer.controller import classes as ranks_classes
from nereus.trainer.controller import search as searching
from nereus.trainer.controller.candidates import Candidates, kept_of
from nereus.trainer.controller.memory import candidate_memory, distinct_ranks, pipeline_memory
from nereus.trainer.controller.evidence import SampleRows
from nereus.trainer.controller.profiles import load_profile
from nereus.trainer.controller.classes import ClassRegistry, MemoryFit
from nereus.trainer.controller.search import _extend, _Partial, _prune, search, stage_candidates
from nereus.trainer.controller.steptime import OP_CLASSES, Placement, StepTimeModel, candidate_features
from nereus.trainer.controller.workload import Workload

CPU = load_profile("cpu")


def _job(*overrides: str):
    return load_config("configs/tiny_ppo.yaml", ["nproc=8", "rollout.prompts_per_step=32", "plan=auto", *overrides])


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_terms_kept_with_the_candidates_follow_the_width_the_workload_and_the_job():
    """One Candidates object priced at two widths, two workloads and under two jobs (another
    mini-batch: other rows per replica) equals fresh Candidates priced once each."""
    cfg = _job()
    other = dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, minibatch_size=cfg.ppo.minibatch_size // 2))
    work = Workload.from_config(cfg)
    where = Placement(nproc=cfg.nproc, profile=CPU)
    kept = stage_candidates(cfg, "critic.train", tuple(range(cfg.nproc)), work.at(work.response_max, work.response_max / 2))
    fresh = lambda: Candidates(layouts=kept.layouts, layout=kept.layout, micro_batch_size=kept.micro_batch_size,  # noqa: E731
                               micro_batch_tokens=kept.micro_batch_tokens, recompute=kept.recompute)
    for job in (cfg, other, cfg):
        for w in (work, work.at(max(1, work.response_max // 3), work.response_max / 5)):
            for seq in (w.width, 2 * w.width + 1):
                got, want = candidate_memory(job, "critic.train", kept, seq=seq), candidate_memory(job, "critic.train", fresh(), seq=seq)
                assert all(np.array_equal(g, x) for g, x in zip(got, want))
            for mode in ("train", "infer"):
                _equal(candidate_features(job, "critic.train", kept, w, where, mode=mode),
                       candidate_features(job, "critic.train", fresh(), w, where, mode=mode))


def test_a_kept_stage_config_prices_its_memory_as_a_fresh_one():
    cfg = _job()
    sc = dataclasses.replace(cfg.plan.actor.train, pp=2, dp=2, recompute="selective", micro_batch_tokens=64)
    for seq in (16, 40, 16):
        got = pipeline_memory(cfg, "actor.train", sc, seq=seq)
        from nereus.trainer.controller.memory import memory_at

        stages = np.arange(sc.pp)
        r, t = memory_at(cfg, "actor.train", Candidates.of([sc]), np.zeros(sc.pp, dtype=np.int64), stages, seq=seq)
        assert [(m.resident, m.transient) for m in got] == list(zip(r.tolist(), t.tolist()))
    assert kept_of((sc,)) is kept_of((sc,))


def _reference_groups(cfg, plans, seq):
    """``distinct_ranks`` as it was: the table of every rank's pipeline stage per model-stage."""
    mems, columns = [], []
    for k, plan in enumerate(plans):
        for key, sc in plan.stages().items():
            ranks = np.array(sc.ranks, dtype=np.int64) if sc.ranks is not None else np.arange(cfg.nproc)
            column = np.full(max(cfg.nproc, int(ranks.max()) + 1), -1, dtype=np.int64)
            column[ranks] = (np.arange(len(ranks)) // sc.tp) % sc.pp
            columns.append(column)
            mems.append((k, pipeline_memory(cfg, key, sc, seq=seq)))
    width = max(len(c) for c in columns)
    table = np.stack([np.pad(c, (0, width - len(c)), constant_values=-1) for c in columns], axis=1)
    held = np.flatnonzero((table >= 0).any(axis=1))
    _, first, inverse = np.unique(table[held], axis=0, return_index=True, return_inverse=True)
    return [(tuple(tuple(m[p] for (j, m), p in zip(mems, row) if j == k and p >= 0) for k in range(len(plans))),
             held[inverse.ravel() == i].tolist()) for i, row in enumerate(table[held[first]].tolist())]


def test_rank_groups_kept_per_placement_follow_the_plans():
    """Plans of other ranks, tp and pp (one of them on ranks beyond the world) group as the
    table computed afresh groups them; the kept rank arrays cannot be written to."""
    cfg = _job()
    base = cfg.plan
    moved = dataclasses.replace(base, actor=dataclasses.replace(base.actor, train=dataclasses.replace(
        base.actor.train, dp=2, tp=2, pp=2, ranks=(2, 3, 4, 5, 6, 7, 8, 9))))
    piped = dataclasses.replace(base, critic=dataclasses.replace(base.critic, train=dataclasses.replace(base.critic.train, dp=4, pp=2)))
    for plans in ((base,), (moved,), (base, moved), (piped,), (base, piped), (base,)):
        for seq in (24, 48):
            got = distinct_ranks(cfg, plans, seq=seq)
            assert [(held, ranks.tolist()) for held, ranks in got] == _reference_groups(cfg, plans, seq)
            with pytest.raises(ValueError):
                got[0][1][0] = 0


@pytest.mark.parametrize("maxlen,count", [(50, 30), (50, 50), (50, 137), (7, 3)])
def test_sample_rows_are_the_calibration_rows_of_the_bounded_samples(maxlen, count):
    """Refit from the kept rows equals refit from the deque, through its wrap-around and with
    samples of no time (held, left out)."""
    rng = random.Random(maxlen * 1000 + count)
    model = StepTimeModel.for_profile(load_profile("h200"))
    samples, rows = deque(maxlen=maxlen), SampleRows(maxlen)
    for _ in range(count):
        features = {k: rng.random() for k in OP_CLASSES if rng.random() < 0.6}
        seconds = rng.choice([0.0, -1.0, rng.random() + 0.01, rng.random()])
        samples.append((features, seconds))
        rows.append(features, seconds)
        assert model.calibrate(list(samples)).coef == model.calibrate_rows(rows.matrix()).coef


def test_the_controller_keeps_each_classes_worst_rank_per_step_and_forgets_no_class():
    """Per step and rank class the record keeps the rank whose peak exceeds the model most
    (the fit's offset is that maximum); a class run once and then left for many steps of
    many ranks is still known (it was forgotten by a record of the last 400 ranks)."""
    from nereus.trainer.controller.classes import fit_memory
    from nereus.trainer.controller.online import MEMORY_STEPS, Controller

    cfg = _job()  # actor.train in two pipeline stages: one class, two groups of ranks that hold unlike
    sc = cfg.plan.actor.train
    cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, actor=dataclasses.replace(cfg.plan.actor, train=dataclasses.replace(sc, dp=sc.dp // 2, pp=2))))
    ctl = Controller(cfg, CPU)
    base = {"step": 1, "response_length": 10.0, "lengths": {"response_max": 12, "response_mean": 10.0}}
    zero = [0] * cfg.nproc
    model = Controller(cfg, CPU).observe(cfg, {**base, "stages": {k: {"seconds": 0.1, "peak_bytes": zero} for k in ("actor.gen", "actor.train", "critic.train")}})["memory"]
    classes, predicted = model["classes"], model["predicted_bytes"]
    spans = {c: {predicted[r] for r in range(cfg.nproc) if classes[r] == c} for c in set(classes)}
    assert max(map(len, spans.values())) > 1  # a class whose ranks are predicted unlike
    # every rank over the model by its own amount, the largest on the class's first rank: neither the first
    # nor the last group (nor the least) of a class gives the fit's offset unless it is the largest
    over = [(1 << 20) * (3 + (r * 5) % 7) for r in range(cfg.nproc)]
    peaks = [[p + o for p, o in zip(predicted, over)], zero, zero]
    metrics = {**base, "stages": {k: {"seconds": 0.1, "peak_bytes": p} for k, p in zip(("actor.gen", "actor.train", "critic.train"), peaks)}}
    line = ctl.observe(cfg, metrics)["memory"]
    assert line["measured_bytes"] == peaks[0] and line["predicted_bytes"] == predicted
    samples = ctl.memory_samples()
    assert sorted(c for c, *_ in samples) == sorted(set(line["classes"]))  # one per class and step
    for cls, r, t, m in samples:
        ranks = [i for i, c in enumerate(line["classes"]) if c == cls]
        offsets = [line["measured_bytes"][i] - line["predicted_bytes"][i] for i in ranks]  # fit: predicted = r + t
        assert m - r - t == max(offsets)
    # 60 steps × 8 ranks of another plan (actor.train recomputing: another class): the first plan's class stays known
    plan = dataclasses.replace(cfg.plan, actor=dataclasses.replace(cfg.plan.actor, train=dataclasses.replace(cfg.plan.actor.train, recompute="full")))
    other = dataclasses.replace(cfg, plan=plan)
    for step in range(2, 62):
        seen = ctl.observe(other, {**metrics, "step": step})["memory"]["classes"]
    left = [x for x in samples if x[0] not in seen]
    assert left and all(x in ctl.memory_samples() for x in left)
    assert set(fit_memory(ctl.memory_samples()).offsets) == set(seen) | {x[0] for x in left}
    assert all(len(r) == MEMORY_STEPS for c, r in ctl.memory_record.items() if c in seen)
    again = Controller(cfg, CPU)  # and a resumed controller has the same record
    again.load_state(ctl.state_dict())
    assert again.memory_samples() == ctl.memory_samples()


def test_a_search_does_not_depend_on_what_earlier_searches_left_in_the_class_registry(monkeypatch):
    cfg = _job()
    work = Workload.from_config(cfg)
    fit = MemoryFit(offsets={"x": 2e5}, unseen=0.3)
    monkeypatch.setattr(ranks_classes, "_REGISTRY", ranks_classes._Registry())
    first = search(cfg, work, CPU, fit=fit, top=8).plans
    search(cfg, work.at(work.response_max // 2, work.response_max / 4), CPU, fit=MemoryFit(), top=8)  # other classes, first
    again = search(cfg, work, CPU, fit=fit, top=8).plans
    monkeypatch.setattr(ranks_classes, "_REGISTRY", ranks_classes._Registry())
    fresh = search(cfg, work, CPU, fit=fit, top=8).plans
    assert first == again == fresh


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("subset", [16, 64, 300])
def test_extend_pruning_the_fastest_first_keeps_what_pruning_everything_keeps(seed, subset, monkeypatch):
    """Growths of many exact ties in seconds and memory, under budgets that bind or not: the
    shortcut (``SUBSET`` rows first) against growing and pruning every row."""
    monkeypatch.setattr(searching, "SUBSET", subset)
    rng = np.random.default_rng(seed)
    n, m, kinds = 40, 30, 4
    base = _job().plan.actor.train
    c = Candidates.of([dataclasses.replace(base, dp=1 + i % kinds) for i in range(m)])
    p = searching.Priced(key="actor.train", group=int(seed % 2), candidates=c, seconds=rng.integers(0, 8, m).astype(np.float64),
                         resident=rng.integers(0, 6, m), transient=rng.integers(0, 6, m), kind=c.layout % kinds,
                         kinds=tuple(f"k{i}" for i in range(kinds)))
    front = np.arange(m)
    shortcut = []  # whether the fastest rows settled it, per case (both ways must occur)
    real = searching._prune

    def prune(grown, *args, **kwargs):
        kept, worst = real(grown, *args, **kwargs)
        shortcut.append((len(grown.seconds) < n * m, len(kept) == args[2]))
        return kept, worst

    monkeypatch.setattr(searching, "_prune", prune)
    for budget in (None, 14.0, 9.0):
        classes = ClassRegistry(MemoryFit(offsets={"a": 1.0}, unseen=0.5))
        ids = np.stack([classes.grow(np.zeros(n, np.int64), "critic.train", rng.integers(0, 3, n), ("x", "y", "z")),
                        np.zeros(n, np.int64)], axis=1)
        partial = _Partial(seconds=rng.integers(0, 20, n).astype(np.float64), resident=rng.integers(0, 6, (n, 2)),
                           transient=rng.integers(0, 6, (n, 2)), classes=ids, picks=np.arange(n)[:, None])
        for beam in (1, 8, 48):
            got, _ = _extend(partial, p, front, classes, budget, beam, final=False)
            grown = partial.grow(p, front, classes)
            want = grown.take(_prune(grown, classes, budget, beam, final=False)[0])
            assert got.picks.tolist() == want.picks.tolist()
            assert got.seconds.tolist() == want.seconds.tolist()
            assert np.array_equal(got.resident, want.resident) and np.array_equal(got.transient, want.transient)
            assert [[classes.kinds[i] for i in row] for row in got.classes.tolist()] == \
                [[classes.kinds[i] for i in row] for row in want.classes.tolist()]
    settled = {done for first, done in shortcut if first}
    assert True in settled and (False in settled or subset > 64)  # the shortcut held, and (few rows first) it fell back


def test_a_profile_with_the_same_links_and_another_device_is_priced_afresh():
    """Terms kept with a candidate set under one profile are not reused under another with the
    same links but another memory bandwidth and core count (the optimizer's seconds read both)."""
    cfg = _job()
    work = Workload.from_config(cfg)
    other = dataclasses.replace(CPU, memory_bandwidth=CPU.memory_bandwidth * 50, cores=16)
    c = stage_candidates(cfg, "actor.train", tuple(range(cfg.nproc)), work)
    fresh = Candidates(layouts=c.layouts, layout=c.layout, micro_batch_size=c.micro_batch_size,
                       micro_batch_tokens=c.micro_batch_tokens, recompute=c.recompute)
    candidate_features(cfg, "actor.train", c, work, Placement(nproc=cfg.nproc, profile=CPU))
    warm = candidate_features(cfg, "actor.train", c, work, Placement(nproc=cfg.nproc, profile=other))
    want = candidate_features(cfg, "actor.train", fresh, work, Placement(nproc=cfg.nproc, profile=other))
    _equal(warm, want)
    assert not np.array_equal(warm["optimizer"], candidate_features(cfg, "actor.train", fresh, work,
                                                                    Placement(nproc=cfg.nproc, profile=CPU))["optimizer"])


def test_a_long_lived_candidate_set_keeps_a_bounded_number_of_terms_and_hands_them_out_read_only():
    """The running plan's stages (``kept_of``) are priced for every config a job moves through:
    their kept terms stay bounded; and a kept term cannot be changed in place by a caller."""
    from nereus.trainer.controller.candidates import DERIVED
    from nereus.trainer.controller.memory import plan_memory

    cfg = load_config("configs/tiny_ppo.yaml")  # an explicit plan
    for i in range(3 * DERIVED):  # configs that differ where the memory model does not read
        plan_memory(dataclasses.replace(cfg, steps=cfg.steps + i), seq=32 + i % 7)
    assert 0 < len(kept_of((cfg.plan.actor.train,))._derived) <= DERIVED
    work = Workload.from_config(cfg)
    c = stage_candidates(cfg, "actor.train", tuple(range(cfg.nproc)), work)
    features = candidate_features(cfg, "actor.train", c, work, Placement(nproc=cfg.nproc, profile=CPU))
    with pytest.raises(ValueError, match="read-only"):
        features["optimizer"] += 1.0
