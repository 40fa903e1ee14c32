"""Activation recompute and token-budget packing in the memory and step-time models, the search
and the controller's urgent path (pure, no processes)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from nereus.trainer.config import JobConfig, StageConfig
from nereus.trainer.prepare import load_config
from nereus.trainer.controller.candidates import layout_of
from nereus.trainer.controller.memory import (
    HEADROOM,
    activation_bytes,
    final_norm_bytes,
    gradient_bytes,
    logits_bytes,
    pipeline_memory,
    plan_memory,
    rank_peak,
)
from nereus.trainer.controller.online import Controller
from nereus.trainer.controller.profiles import load_profile
from nereus.trainer.controller.search import search, stage_options, stage_seconds
from nereus.trainer.controller.steptime import Placement, StepTimeModel, stage_features
from nereus.trainer.controller.transition import rebuilt_stages
from nereus.trainer.controller.workload import Workload
from nereus.trainer.models.args import model_args

CPU = load_profile("cpu")
LONG = ["nproc=1", "plan={actor: {train: {dp: 1}, gen: {dp: 1}}}", "grpo.kl_coef=0", "model.num_layers=8", "model.intermediate_size=768", "model.max_seq_len=512",
        "rollout.max_new_tokens=400", "controller.max_pp=1"]


def long_job(*overrides: str):
    """A one-rank GRPO job (actor.train and actor.gen) whose 405-token rows make the training
    activations of 8 wide blocks the peak."""
    return load_config("configs/tiny_grpo.yaml", [*LONG, *overrides])


def _train(cfg, **change):
    return dataclasses.replace(cfg.plan.actor.train, **change)


def test_full_recompute_keeps_each_blocks_input_and_one_block():
    """Without recompute backward keeps every block's activations (A bytes per token and
    block) and, at its start, the head's (H: final norm, logits, softmax), then one block's
    gradient temporaries G; with ``full`` each block keeps its input (c·h) and one block is
    recomputed at a time once the head's are freed, so the saving is tokens × (L·A − L·c·h +
    max(0, G − H) − max(0, G + A − H)); ``selective`` saves it for half the blocks. On-policy: no forward over the whole batch before the update (``JobConfig.own_forward``)."""
    cfg = long_job(f"grpo.minibatch_size={long_job().batch_size}")
    seq, rows = 405, 8
    spec = model_args(cfg, "actor.train").spec
    per_block = int(activation_bytes(spec, 1, "float32", train=True))
    head = final_norm_bytes(spec, "float32") + spec.vocab_size * logits_bytes("float32", cfg.rollout.temperature)
    tokens, layers, kept = rows * seq, spec.num_layers, 4 * spec.hidden_size
    none, selective, full = (pipeline_memory(cfg, "actor.train", _train(cfg, micro_batch_size=rows, recompute=r), seq=seq)[0]
                             for r in ("none", "selective", "full"))
    assert none.resident == full.resident == selective.resident
    assert head < per_block
    grads = gradient_bytes(spec, 1, "float32")  # a block's backward: its gradient temporaries (+ recomputed activations)
    backward = lambda recomputed: max(0, grads + recomputed - head)  # noqa: E731  (beyond the head's, freed by then)
    assert none.transient - full.transient == tokens * (layers * per_block - layers * kept + backward(0) - backward(per_block))
    assert none.transient - selective.transient == tokens * (layers // 2 * per_block - layers // 2 * kept + backward(0) - backward(per_block))
    activations = tokens * layers * per_block
    assert (none.transient - full.transient) / activations > 0.8  # most of what backward keeps


def test_recompute_costs_one_more_forward_of_the_blocks():
    """Training runs forward + backward ≈ 3 forwards of matmuls; recompute adds the blocks'
    forward once more (not the head's): gemm × (3·B + 3·H + B) / (3·B + 3·H)."""
    cfg = long_job()
    work, where, model = Workload.from_config(cfg), Placement(nproc=1, profile=CPU), StepTimeModel.for_profile(CPU)
    f = {r: stage_features(cfg, "actor.train", _train(cfg, micro_batch_size=8, recompute=r), work, where) for r in ("none", "selective", "full")}
    blocks_share = f["full"]["gemm"] / f["none"]["gemm"] - 1  # = B / (3·(B + H))
    assert 0.25 < blocks_share < 1 / 3  # the head (vocab 16) is small against 8 blocks
    assert f["selective"]["gemm"] - f["none"]["gemm"] == pytest.approx((f["full"]["gemm"] - f["none"]["gemm"]) / 2)
    assert f["full"]["ops"] > f["selective"]["ops"] > f["none"]["ops"]
    seconds = {r: stage_seconds(cfg, "actor.train", _train(cfg, micro_batch_size=8, recompute=r), work, where, model) for r in f}
    assert seconds["full"] > seconds["selective"] > seconds["none"]


def test_packing_prices_real_tokens_and_its_budget():
    """Packed micro-batches hold ``micro_batch_tokens`` tokens: memory scales with the budget,
    not with rows × the longest row; time with the real tokens, ceil(real / budget) packs
    (rows a quarter as long as the longest on average: about a quarter of the padded matmuls)
    with one attention call per row."""
    cfg = long_job()
    longest = 405
    half, whole = (pipeline_memory(cfg, "actor.train", _train(cfg, micro_batch_tokens=k * longest), seq=longest)[0] for k in (8, 16))
    padded = pipeline_memory(cfg, "actor.train", _train(cfg, micro_batch_size=8), seq=longest)[0]
    spec = model_args(cfg, "actor.train").spec
    # what backward keeps, then one block's gradient temporaries (larger than the head's here)
    per_token = spec.num_layers * int(activation_bytes(spec, 1, "float32", train=True)) + gradient_bytes(spec, 1, "float32")
    assert whole.transient - half.transient == pytest.approx(8 * longest * per_token, rel=0.03)  # + RoPE's tables, the head's
    # 8 full rows either way; a pack's rows attend one by one, without the [405, 405] bool mask
    # of every padded row and SDPA's float32 copy of it
    assert padded.transient - half.transient == (1 + 4) * 8 * longest**2
    where = Placement(nproc=1, profile=CPU)
    full = Workload.from_config(cfg)
    short = full.at(full.response_max, full.response_max / 4)  # the longest row 405 tokens, the mean 105
    packed = stage_features(cfg, "actor.train", _train(cfg, micro_batch_tokens=longest), short, where)
    padding = stage_features(cfg, "actor.train", _train(cfg, micro_batch_size=8), short, where)
    real = 128 * short.row_mean  # the replica's mini-batch, padding removed
    packs = -(-real // longest)
    tokens = packs * longest / (128 * longest)  # every pack as wide as the budget
    # the linear layers scale with the packs' tokens; attention also with the rows' length
    assert tokens * short.row_mean / longest < packed["gemm"] / padding["gemm"] < tokens
    halved = stage_features(cfg, "actor.train", _train(cfg, micro_batch_size=16), short, where)
    per_micro_batch = (padding["ops"] - halved["ops"]) / (16 - 8)
    # 34 packs against 16 micro-batches of 8 rows, and in each pack attention row by row
    assert packed["ops"] - padding["ops"] > (packs - 16) * per_micro_batch
    same = stage_features(cfg, "actor.train", _train(cfg, micro_batch_tokens=8 * longest), full, where)
    assert same["gemm"] == pytest.approx(padding["gemm"])  # full rows: nothing to remove, each row attends over itself
    assert same["ops"] > padding["ops"]  # but one attention call per row


def _budgets(cfg, width: int | None = None):
    """(smallest peak of the actor.train options without recompute, with recompute) at rows of ``width``."""
    work = Workload.from_config(cfg)
    width = width or work.width
    peaks: dict[bool, float] = {False: float("inf"), True: float("inf")}
    for sc in stage_options(cfg, "actor.train", (0,), work):
        plan = dataclasses.replace(cfg.plan, actor=dataclasses.replace(cfg.plan.actor, train=sc))
        peak = max(rank_peak(stages)[0] for stages in plan_memory(cfg, plan, seq=width).values()) * HEADROOM
        peaks[sc.recompute != "none"] = min(peaks[sc.recompute != "none"], peak)
    return peaks[False], peaks[True]


def test_the_search_takes_recompute_when_nothing_else_fits_and_not_when_memory_is_ample():
    cfg = long_job("controller.stages=[actor.train]")
    without, with_recompute = _budgets(cfg)
    assert with_recompute < 0.7 * without
    tight = dataclasses.replace(cfg, device_memory_gib=(without + with_recompute) / 2 / 2**30)
    work = Workload.from_config(cfg)
    best = search(tight, work, CPU).best
    assert best.plan.actor.train.recompute != "none"
    assert max(best.peak_bytes.values()) <= tight.device_memory_gib * 2**30
    ample = dataclasses.replace(cfg, device_memory_gib=2 * without / 2**30)
    assert search(ample, work, CPU).best.plan.actor.train.recompute == "none"  # recompute only costs time


def _grown(controller: Controller, steps: list[tuple[int, float]]) -> None:
    controller.lengths = list(steps)
    controller.watch.reset({"response_max": float(steps[-1][0]), "response_mean": steps[-1][1]})
    controller.step = len(steps)


def test_the_urgent_path_turns_recompute_on():
    """The running plan (the smallest micro-batches, no recompute) no longer fits the coming
    step's longer answers and only recompute fits: the urgent decision turns it on."""
    base = long_job("controller.stages=[actor.train]", "controller.enabled=true", "plan.actor.train.micro_batch_size=8", "steps=40")
    without, with_recompute = _budgets(base)
    cfg = dataclasses.replace(base, device_memory_gib=(without + with_recompute) / 2 / 2**30)
    controller = Controller(cfg, CPU)
    _grown(controller, [(100, 80.0), (250, 200.0), (400, 390.0)])  # 400 = max_new_tokens: the coming step is the longest
    decision = controller.decide(cfg)
    assert decision is not None and decision.urgent and "infeasible" in decision.trigger and decision.admitted, decision
    new = decision.new_plan["actor"]["train"]
    assert new["recompute"] in ("selective", "full")
    assert {k: new[k] for k in ("dp", "tp", "pp", "dp_shard")} == {"dp": 1, "tp": 1, "pp": 1, "dp_shard": False}
    assert decision.transition_seconds == 0.0  # a retune: nothing is rebuilt


def test_the_urgent_path_tries_recompute_before_giving_up():
    """Answers grow 100 tokens a step: no plan fits the step 8 ahead (the lookahead), so the
    search finds none; recompute on the running layout fits the coming step, and is taken
    rather than running on over the budget."""
    base = long_job("controller.stages=[actor.train]", "controller.enabled=true", "plan.actor.train.micro_batch_size=8", "steps=40",
                    "model.max_seq_len=1024", "rollout.max_new_tokens=1000")
    without, with_recompute = _budgets(base, width=405)
    cfg = dataclasses.replace(base, device_memory_gib=(without + with_recompute) / 2 / 2**30)
    assert min(_budgets(base, width=1005)) > cfg.device_memory_gib * 2**30  # nothing fits 1,000-token answers
    controller = Controller(cfg, CPU)
    _grown(controller, [(100, 90.0), (200, 190.0), (300, 290.0)])  # the coming step: 400; 8 ahead: 1,000
    assert Workload.observed(cfg, controller.lengths).width == 405
    decision = controller.decide(cfg)
    assert decision is not None and decision.admitted and decision.urgent, decision
    assert decision.new_plan["actor"]["train"]["recompute"] in ("selective", "full")
    assert decision.new_plan["actor"]["train"]["micro_batch_size"] == 8
    cfg_before = dataclasses.replace(cfg, device_memory_gib=with_recompute / 4 / 2**30)  # not even recompute fits: it gives up
    decision = Controller(cfg_before, CPU)
    _grown(decision, [(100, 90.0), (200, 190.0), (300, 290.0)])
    refused = decision.decide(cfg_before)
    assert refused is not None and not refused.admitted and refused.reason.startswith("no plan fits")


def test_the_controller_reads_the_mean_real_row_from_the_stages_real_tokens():
    """Packing is priced on real tokens: the step's records count them (``real_tokens`` per
    ``rows``); less the mean response, that is the mean prompt the coming workload carries."""
    from nereus.trainer.controller.pieces import observed_prompt_mean

    cfg = long_job()
    metrics = {"step": 1, "response_length": 100.0, "lengths": {"response_max": 400, "width": 405, "prompt": 5},
               "stages": {"actor.train": {"seconds": 1.0, "rows": 256, "tokens": 256 * 405, "real_tokens": 256 * 103.5,
                                          "peak_bytes": [1 << 20]}}}
    assert observed_prompt_mean(metrics) == pytest.approx(3.5)
    assert observed_prompt_mean({**metrics, "stages": {"actor.train": {"seconds": 1.0, "rows": 256}}}) is None
    controller = Controller(cfg, CPU)
    controller.observe(cfg, metrics)
    assert controller.prompt_mean == pytest.approx(3.5)
    work = Workload.observed(cfg, controller.lengths, prompt_mean=controller.prompt_mean)
    assert work.row_mean == pytest.approx(103.5) and work.width == 405


def test_the_urgent_path_can_always_retune_the_running_layouts_in_place():
    """Over the budget, the running layouts' own micro-batch retunes are candidates even when
    other layouts fill the whole search's top plans (its frontier ignores what a move costs):
    here smaller micro-batches fit, move nothing and beat every rebuild and every recompute."""
    cfg = load_config("configs/tiny_ppo.yaml", ["controller.enabled=true", "steps=40"])
    work = Workload.from_config(cfg)
    running = {key: layout_of(sc) for key, sc in cfg.plan.stages().items()}
    same = lambda plan: all(layout_of(sc) == running[key] for key, sc in plan.stages().items())  # noqa: E731
    assert not any(same(c.plan) for c in search(cfg, work, CPU, top=12).plans)  # what the urgent path had to choose from
    retunes = search(cfg, work, CPU, top=100, retunes_of=cfg.plan).plans
    assert retunes and all(same(c.plan) for c in retunes)
    peak = Controller(cfg, CPU)._peak(cfg, cfg.plan, work)
    smallest = min(max(c.peak_bytes.values()) for c in retunes)
    tight = dataclasses.replace(cfg, device_memory_gib=(peak + smallest) / 2 / 2**30)
    controller = Controller(tight, CPU)
    longest = work.response_max
    _grown(controller, [(longest, 0.9 * longest)] * 3)
    decision = controller.decide(tight)
    assert decision is not None and decision.urgent and decision.admitted, decision
    new = load_config("configs/tiny_ppo.yaml", ["controller.enabled=true", "steps=40", f"plan={json.dumps(decision.new_plan)}"]).plan
    assert same(new) and new != cfg.plan and decision.transition_seconds == 0.0
    assert {sc.recompute for sc in new.stages().values()} == {"none"}  # smaller micro-batches: faster than recomputing


def test_a_training_stage_that_runs_its_own_forward_is_held_to_that_forwards_memory(monkeypatch):
    """Off-policy the actor's update (here over a quarter of the batch) is preceded by its
    forward over the whole batch (the old log-probs): recompute shrinks the update, not that
    forward, which then sets the peak — as large as the reference's forward in the same
    layout (the same shapes)."""
    import nereus.trainer.controller.memory as memory

    cfg = long_job()
    cfg = long_job(f"grpo.minibatch_size={cfg.batch_size // 4}", "grpo.kl_coef=0.01", "plan.ref.infer.dp=1")
    assert not cfg.on_policy
    full = lambda: pipeline_memory(cfg, "actor.train", _train(cfg, recompute="full"), seq=405)[0].transient  # noqa: E731
    forward = pipeline_memory(cfg, "ref.infer", cfg.plan.ref.infer, seq=405)[0].transient
    held = full()
    monkeypatch.setattr(JobConfig, "own_forward", lambda self, key: False)
    memory._pipeline_memory.cache_clear()
    update = full()
    memory._pipeline_memory.cache_clear()
    assert update < forward <= held


def test_gpipe_keeps_every_micro_batch_and_its_logits_on_the_last_stage():
    """Fewer micro-batches than pipeline stages run under GPipe: every forward before any
    backward, so the last stage holds each micro-batch's activations and logits at once."""
    cfg = load_config("configs/tiny_ppo.yaml", ["nproc=4", "model.num_layers=4", "model.vocab_size=4096"])
    rows = -(-cfg.ppo.minibatch_size // 1)
    one, two = (pipeline_memory(cfg, "actor.train", StageConfig(dp=1, pp=4, micro_batch_size=rows // n), seq=32)[-1] for n in (4, 2))
    spec = model_args(cfg, "actor.train").spec
    logits = rows // 2 * 32 * spec.vocab_size * logits_bytes("float32", cfg.rollout.temperature)
    assert two.transient >= 2 * logits  # two micro-batches of half the rows each, both held
    assert two.transient > 1.8 * one.transient  # 1F1B on 4: the last stage holds one of a quarter


@pytest.mark.parametrize("how", ["ranks-named", "split"])
def test_retunes_keep_the_ranks_each_stage_runs_on(how):
    """In-place retunes of a plan whose stages name their ranks (all of them, or the two
    halves of a split placement) keep those ranks and layouts."""
    cfg = load_config("configs/tiny_ppo.yaml", ["controller.enabled=true"])
    work = Workload.from_config(cfg)
    if how == "ranks-named":
        plan = dataclasses.replace(cfg.plan, actor=dataclasses.replace(cfg.plan.actor, train=dataclasses.replace(cfg.plan.actor.train, ranks=(0, 1, 2, 3))))
    else:
        plan = search(cfg, work, CPU, placements=("split",)).best.plan
        assert len({sc.ranks for sc in plan.stages().values()}) == 2
    running = {key: layout_of(sc) for key, sc in plan.stages().items()}
    retunes = search(dataclasses.replace(cfg, plan=plan), work, CPU, top=100, retunes_of=plan).plans
    assert len(retunes) > 1
    for choice in retunes:
        assert {key: layout_of(sc) for key, sc in choice.plan.stages().items()} == running
        assert not rebuilt_stages(plan, choice.plan)


def test_a_middle_pipeline_stage_under_selective_recompute_is_priced_too():
    """12 layers on 4 stages, every even layer checkpointed: stage 1 (layers 3-5) checkpoints
    one block of three, stage 0 two, so stage 1 can hold more with one micro-batch fewer in
    flight; the search's price of a candidate is its largest stage's."""
    from nereus.trainer.controller.candidates import Candidates
    from nereus.trainer.controller.memory import candidate_memory

    cfg = load_config("configs/tiny_ppo.yaml", ["nproc=4", "model.num_layers=12", "model.vocab_size=64"])
    sc = StageConfig(dp=1, pp=4, micro_batch_size=8, recompute="selective")
    stages = pipeline_memory(cfg, "actor.train", sc, seq=32)
    assert max(s.transient for s in stages[1:-1]) > max(stages[0].transient, stages[-1].transient)  # the case
    resident, transient = candidate_memory(cfg, "actor.train", Candidates.of([sc]), seq=32)
    assert transient[0] == max(s.transient for s in stages) and resident[0] == max(s.resident for s in stages)
