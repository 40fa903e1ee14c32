"""The search, pricing every candidate of a stage at once, returns exactly what the reference
below returns: the search as it was before it was vectorized, pricing one candidate at a time
through the scalar models (``stage_seconds``, ``pipeline_memory``) and combining Python tuples."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from nereus.trainer.prepare import load_config
from nereus.trainer.controller.memory import HEADROOM, pipeline_memory
from nereus.trainer.controller.profiles import load_profile
from nereus.trainer.controller.search import (
    PLACEMENTS,
    MemoryFit,
    Priced,
    _prune,
    device_budget,
    frontier,
    layout_kind,
    placement_groups,
    rank_class,
    search,
    stage_options,
    stage_seconds,
)
from nereus.trainer.controller.steptime import Placement, StepTimeModel
from nereus.trainer.controller.workload import Workload

CPU = load_profile("cpu")


# --------------------------------------------------------------------------- the reference


@dataclasses.dataclass(frozen=True)
class Candidate:
    key: str
    config: object
    seconds: float
    resident: int
    transient: int
    group: int
    kind: str


def undominated(mem: np.ndarray, limit: int | None = None) -> list[int]:
    n = len(mem)
    if n == 0:
        return []
    le = (mem[None, :, :] <= mem[:, None, :]).all(axis=2)
    keep = ~np.tril(le, k=-1).any(axis=1)
    idx = np.flatnonzero(keep)
    return idx[:limit].tolist() if limit else idx.tolist()


def reference_frontier(candidates: list[Candidate]) -> list[Candidate]:
    out = []
    for kind in sorted({c.kind for c in candidates}):
        ordered = sorted((c for c in candidates if c.kind == kind), key=lambda c: (c.seconds, c.resident, c.transient))
        mem = np.array([[c.resident, c.transient] for c in ordered], dtype=np.float64).reshape(-1, 2)
        out += [ordered[i] for i in undominated(mem)]
    return sorted(out, key=lambda c: c.seconds)


def reference_prune(grown: list, budget, beam: int, *, final: bool):
    if not grown:
        return [], math.inf
    res = np.array([g[1] for g in grown], dtype=np.float64)
    tr = np.array([g[2] for g in grown], dtype=np.float64)
    if final:
        corr = np.array([g[5] for g in grown], dtype=np.float64)
        offset, margin = corr[..., 0], corr[..., 1]
        peak = res + tr + np.maximum(offset, margin * (res + tr)) + (HEADROOM - 1.0) * tr  # the excess, then headroom on the transients
        mem = np.hstack([res, tr, offset, margin])
    else:
        peak, mem = res + tr * HEADROOM, np.hstack([res, tr])
    worst = peak.max(axis=1)
    ok = worst <= budget if budget is not None else np.ones(len(grown), dtype=bool)
    idx = np.flatnonzero(ok)
    if not len(idx):
        return [], float(worst.min())
    idx = idx[np.argsort([grown[i][0] for i in idx], kind="stable")]
    classes: dict = {}
    for i in idx:
        classes.setdefault(None if final else grown[i][4], []).append(i)
    kept = []
    for members in classes.values():
        members = np.array(members[: 8 * beam])
        kept += [members[j] for j in undominated(mem[members], beam)]
    kept.sort(key=lambda i: grown[i][0])
    return [grown[i] for i in kept[:beam]], float(worst.min())


def reference_search(cfg, work, profile, model, *, fit=MemoryFit(), top=5, beam=48):
    """(seconds, stage seconds, peaks, placement, plan's stage configs) of the ``top`` best."""
    where = Placement(nproc=cfg.nproc, profile=profile)
    budget = device_budget(cfg, profile)
    choices = []
    for placement in PLACEMENTS:
        if placement == "split" and (cfg.nproc < 2 or cfg.rollout.engine == "vllm" or cfg.controller.stages is not None):
            continue
        fronts = {}
        for key, (group, ranks) in placement_groups(cfg, placement).items():
            cands = []
            for sc in stage_options(cfg, key, ranks, work):
                mem = pipeline_memory(cfg, key, sc, seq=work.width, ends=True)
                cands.append(Candidate(key=key, config=sc, seconds=stage_seconds(cfg, key, sc, work, where, model),
                                       resident=max(m.resident for m in mem), transient=max(m.transient for m in mem),
                                       group=group, kind=layout_kind(sc)))
            fronts[key] = reference_frontier(cands)
        none = fit.terms(rank_class(()))
        partial = [(0.0, (0, 0), (0, 0), (), ((), ()), (none, none))]
        classes: dict = {}
        for depth, (key, front) in enumerate(fronts.items(), 1):
            grown = []
            for secs, res, tr, picked, kinds, corr in partial:
                for c in front:
                    g = c.group
                    r, t = list(res), list(tr)
                    r[g] += c.resident
                    t[g] = max(t[g], c.transient)
                    k, co = kinds, corr
                    if key.endswith(".train"):
                        step = (kinds[g], key, c.kind)
                        if step not in classes:
                            grown_kinds = (*kinds[g], (key, c.kind))
                            classes[step] = (grown_kinds, fit.terms(rank_class(grown_kinds)))
                        got = classes[step]
                        k = (got[0], kinds[1]) if g == 0 else (kinds[0], got[0])
                        co = (got[1], corr[1]) if g == 0 else (corr[0], got[1])
                    grown.append((secs + c.seconds, tuple(r), tuple(t), (*picked, c), k, co))
            partial, _ = reference_prune(grown, budget, beam, final=depth == len(fronts))
            if not partial:
                break
        for secs, res, tr, picked, kinds, _ in partial:
            peaks = {g: fit.peak(res[g], tr[g], rank_class(kinds[g])) + (HEADROOM - 1.0) * tr[g] for g in sorted({c.group for c in picked})}
            choices.append((secs, {c.key: c.seconds for c in picked}, peaks, placement, {c.key: c.config for c in picked}))
    choices.sort(key=lambda c: c[0])
    return choices[:top]


# --------------------------------------------------------------------------- the tests


def _jobs():
    grpo = load_config("configs/tiny_grpo.yaml", ["nproc=4"])
    ppo = load_config("configs/tiny_ppo.yaml")
    wide = load_config("configs/tiny_ppo.yaml", ["nproc=8", "rollout.prompts_per_step=32", "plan=auto"])
    return {"grpo": grpo, "ppo": ppo, "ppo-8-ranks": wide}


@pytest.mark.parametrize("job", ["grpo", "ppo", "ppo-8-ranks"])
@pytest.mark.parametrize("budget", [None, 0.5, 0.15])
def test_the_search_returns_what_pricing_one_candidate_at_a_time_returns(job, budget):
    """Plans, predicted seconds per stage and calibrated peaks, in order: unbounded, and under
    budgets that bind, with a calibrated memory correction and a half-length workload (so that
    packing and recompute are on the frontier)."""
    cfg = _jobs()[job]
    work = Workload.from_config(cfg)
    work = work.at(max(1, work.response_max // 2), work.response_max / 3)
    model = StepTimeModel(prior=CPU.efficiency, coef={"gemm": 6.3, "ops": 3.3, "ops_tp": 4.7, "comm_tp": 4.0, "comm_dp": 0.7, "call": 5.6})
    fit = MemoryFit(offsets={rank_class(cfg.plan.stages().items()): 3e5}, unseen=0.25)
    if budget is not None:
        every = reference_search(cfg, work, CPU, model, fit=fit, top=10**6)
        peaks = [max(p.values()) for _, _, p, _, _ in every]
        cfg = dataclasses.replace(cfg, device_memory_gib=(min(peaks) + budget * (peaks[0] - min(peaks))) / 2**30)
        assert max(every[0][2].values()) > cfg.device_memory_gib * 2**30, "the budget does not bind"
    want = reference_search(cfg, work, CPU, model, fit=fit, top=12)
    got = search(cfg, work, CPU, model, fit=fit, top=12).plans
    assert len(got) == len(want) > 0
    for choice, (seconds, per_stage, peaks, placement, configs) in zip(got, want):
        assert choice.plan.stages() == configs
        assert (choice.seconds, choice.stage_seconds, choice.peak_bytes, choice.placement) == (seconds, per_stage, peaks, placement)


def test_the_search_space_holds_recompute_and_token_budgets():
    """Recompute for training stages; token budgets where rows are shorter than the batch's
    width on average (padding to remove), none where every row is full."""
    cfg = _jobs()["ppo"]
    full = Workload.from_config(cfg)
    assert not any(sc.micro_batch_tokens for sc in stage_options(cfg, "actor.train", tuple(range(4)), full))
    work = full.at(full.response_max, full.response_max / 2)
    train = stage_options(cfg, "actor.train", tuple(range(4)), work)
    infer = stage_options(cfg, "ref.infer", tuple(range(4)), work)
    assert {sc.recompute for sc in train} == {"none", "selective", "full"}
    assert {sc.recompute for sc in infer} == {"none"}
    longest = 5 + cfg.rollout.max_new_tokens  # the toy prompt and the longest answer
    for options in (train, infer):
        budgets = {sc.micro_batch_tokens for sc in options} - {None}
        assert budgets and all(t % longest == 0 for t in budgets)
        assert not any(sc.micro_batch_tokens and sc.micro_batch_size for sc in options)
    # every option is a valid stage config of the job
    for sc in train[:: max(1, len(train) // 20)]:
        load_config("configs/tiny_ppo.yaml", [f"plan.actor.train={_flow(sc)}"])


def _flow(sc) -> str:
    fields = {k: v for k, v in dataclasses.asdict(sc).items() if v is not None}
    return "{" + ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()) + "}"


def _random_priced(rng, n: int, kinds: int, group: int = 0, key: str = "actor.train") -> Priced:
    """Candidates with many exact ties (small integers) in seconds and memory."""
    from nereus.trainer.controller.candidates import Candidates
    from nereus.trainer.config import StageConfig

    c = Candidates.of([StageConfig(dp=1 + i % kinds) for i in range(n)])
    names = tuple(f"k{i}" for i in range(kinds))
    return Priced(key=key, group=group, candidates=c, seconds=rng.integers(0, 12, n).astype(np.float64),
                  resident=rng.integers(0, 6, n), transient=rng.integers(0, 6, n),
                  kind=c.layout % kinds, kinds=names)


@pytest.mark.parametrize("block", [128, 5])
@pytest.mark.parametrize("seed", range(6))
def test_frontier_and_pruning_equal_the_quadratic_reference_with_ties(seed, block, monkeypatch):
    """Also with blocks of 5 rows: the scan's early stop then falls inside runs of equal seconds."""
    from nereus.trainer.controller import search as searching

    monkeypatch.setattr(searching, "BLOCK", block)
    rng = np.random.default_rng(seed)
    p = _random_priced(rng, 400, 5)
    cands = [Candidate(key=p.key, config=i, seconds=float(p.seconds[i]), resident=int(p.resident[i]), transient=int(p.transient[i]),
                       group=0, kind=p.kinds[p.kind[i]]) for i in range(len(p.seconds))]
    assert frontier(p).tolist() == [c.config for c in reference_frontier(cands)]

    from nereus.trainer.controller.classes import ClassRegistry
    from nereus.trainer.controller.search import _Partial

    fit = MemoryFit(offsets={"a": 1.0, "b": 3.0}, unseen=0.5)
    classes = ClassRegistry(fit)
    n = 3000
    for final, budget in ((False, None), (False, 20.0), (True, 25.0)):
        ids = np.stack([rng.integers(0, 1, n), rng.integers(0, 1, n)], axis=1)
        if not final:  # partial plans of a few classes
            for g in range(2):
                ids[:, g] = classes.grow(ids[:, g], f"m{g}.train", rng.integers(0, 3, n), ("x", "y", "z"))
        grown = _Partial(seconds=rng.integers(0, 40, n).astype(np.float64), resident=rng.integers(0, 12, (n, 2)),
                         transient=rng.integers(0, 12, (n, 2)), classes=ids, picks=np.arange(n)[:, None])
        got, worst = _prune(grown, classes, budget, 48, final=final)
        tuples = [(float(grown.seconds[i]), tuple(grown.resident[i].tolist()), tuple(grown.transient[i].tolist()), (i,),
                   (classes.kinds[ids[i, 0]], classes.kinds[ids[i, 1]]), (classes.terms[ids[i, 0]], classes.terms[ids[i, 1]]))
                  for i in range(n)]
        want, want_worst = reference_prune(tuples, budget, 48, final=final)
        assert got.tolist() == [w[3][0] for w in want]
        assert worst == want_worst


@pytest.mark.parametrize(("overrides", "tps"), [([], {1}), (["device_profile=h100", "model.num_heads=2", "model.num_kv_heads=2"], {1, 2})])
def test_the_search_offers_only_the_rollout_layouts_the_engine_admits(overrides, tps):
    """actor.gen's candidates are filtered by the engine's own rules (rollout/engine.py's
    ``check_rollout_plan``): vLLM fused, pp=1, over the world; tp=1 on its CPU build."""
    from nereus.trainer.controller.search import stage_candidates
    from nereus.trainer.controller.workload import Workload
    from nereus.trainer.rollout.engine import check_rollout_plan
    from nereus.trainer.config import decoder_spec

    cfg = load_config("configs/tiny_vllm.yaml", overrides)
    c = stage_candidates(cfg, "actor.gen", tuple(range(cfg.nproc)), Workload.from_config(cfg))
    assert {sc.tp for sc in c.layouts} == tps
    for sc in c.layouts:
        assert sc.fused and sc.pp == 1
        check_rollout_plan(sc, "vllm", spec=decoder_spec(cfg.model), world=cfg.nproc, cpu=cfg.device_profile == "cpu")


def test_plan_auto_with_a_head_size_vllms_cpu_build_cannot_run_still_names_the_head_size():
    """The search applies vLLM's CPU tp rule only: ``plan: auto`` finds a plan, and the head size
    is the environment check's one-line error, not a search that finds no rollout layout."""
    from nereus.trainer.config import ConfigError
    from nereus.trainer.prepare import check_job_on_vllm_cpu

    cfg = load_config("configs/tiny_vllm.yaml", ["model.num_heads=4", "model.num_kv_heads=4", "plan=auto"])
    assert cfg.plan.actor.gen.tp == 1 and cfg.plan.actor.gen.fused
    with pytest.raises(ConfigError, match=r"vLLM's CPU attention runs head_dim .* but 'model' has head_dim 16"):
        check_job_on_vllm_cpu(cfg)
