"""Model-stages at run time: build each in its layout, run it on its share of the batch.

Every rank builds every model-stage it belongs to (``plan.<model>.<stage>`` of the job
config); all ranks create every stage's process groups in the same order first
(``new_group`` is collective over the world). Model-stages are co-located and run one
after another, as verl's hybrid engine does: generation, then inference, then training.

``actor.gen`` samples through its ``engine`` (a ``RolloutEngine``, trainer/rollout/engine.py): the
built-in generator over its own module, or, with ``rollout.engine: vllm``, a ``VLLMEngine``
(trainer/rollout/vllm_engine.py) instead of a Nereus module: its EMUs are vLLM's fused layout
and its buffers vLLM's live parameters, so the weight sync writes straight into vLLM.

Batch split: a stage with dp replicas gives replica d the rows ``tensor_split(B, dp)[d]``;
all TP and PP ranks of a replica see the same rows. With ``micro_batch_tokens`` the rows are
first ordered so that those shares hold about equal tokens, and each replica packs its rows,
padding removed, into micro-batches of at most that many tokens (``trainer/parallel/packing.py``).
Training stages checkpoint the activations of the layers ``recompute`` names
(``model.recompute_layers``), read from the stage's settings at each call, so a plan
transition retunes it in place. Results come back to every rank with
one ``all_gather_object`` per call (the tiny CPU jobs move kilobytes; a GPU job would
gather tensors instead).

Devices: every stage is built on the job's device (``build_stages(..., device)``: CPU, or
this process's GPU). The step's batch lives on CPU; a stage moves its rows to its device
where it consumes them (``infer``, ``backward_minibatch``) and ``gather_rows`` brings results
back to CPU before pickling them (a CUDA tensor in ``all_gather_object`` would be unpickled
onto the sender's GPU index on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nereus.reshard.derive import derive_emus
from nereus.reshard.layout import EMU, ParallelConfig

from ..config import JobConfig, StageConfig
from ..algos.ppo import LossSums
from ..config.names import ACTOR, ACTOR_GEN, GEN, is_gen, is_train, model_of, stage_of
from ..models.args import model_args
from ..models.decoder import ModelArgs, set_recompute
from ..parallel.packing import Packing, balanced_order, pack_batch, pack_count
from ..parallel.groups import cached_group, plan_groups, stage_groups
from ..parallel.parallelize import StagePart, build_stage, optimizer_buffers, stage_buffers, stage_grads
from ..parallel.pipeline import forward, forward_backward
from ..rollout.engine import RolloutEngine, check_rollout_plan
from ..rollout.generator import BuiltinEngine
from ..rollout.vllm_engine import VLLMEngine, vllm_emus
from ..parallel.vocab_parallel import VocabShard, token_logprobs


@dataclass(kw_only=True)
class ModelStage:
    """One model-stage (e.g. ``actor.train``) as this rank sees it; ``part`` None off its ranks."""

    key: str
    args: ModelArgs
    config: ParallelConfig
    settings: StageConfig
    """The plan's entry for this model-stage (dp_shard, micro_batch_size, ...)."""
    part: StagePart | None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
    """Training stages: the LR schedule, positioned at the optimizer's step (``trainer/runtime/lr_schedule.py``)."""
    emus: list[EMU] = field(default_factory=list)
    group: dist.ProcessGroup | None = None
    """All ranks of the model-stage (None: the world)."""
    norm_weights: dict[str, float] = field(default_factory=dict)
    """Per local parameter: 1 / holders of its box in this rank's EMU (see ``clip_grads``)."""
    engine: RolloutEngine | None = None
    """``actor.gen`` on its ranks: what samples the rollouts, the built-in generator over
    ``part``'s module or, under ``rollout.engine: vllm``, vLLM (which holds the weights: ``part``
    is None). None for every other stage."""

    @property
    def dp_shard(self) -> bool:
        return self.settings.dp_shard

    @property
    def member(self) -> bool:
        return self.part is not None or self.engine is not None

    @property
    def vllm(self) -> VLLMEngine | None:
        """The engine when it is vLLM's (it holds the stage's weights and coordinates)."""
        return self.engine if isinstance(self.engine, VLLMEngine) else None

    def buffers(self) -> dict[str, torch.Tensor]:
        """Rank-local views of the parameters (and AdamW state for training stages)."""
        if self.part is None:
            return self.param_buffers()
        out = stage_buffers(self.part)
        if self.optimizer is not None:
            out.update(optimizer_buffers(self.part, self.optimizer))
        return out

    def param_buffers(self) -> dict[str, torch.Tensor]:
        if self.vllm is not None:
            return self.vllm.param_buffers()
        return {} if self.part is None else stage_buffers(self.part)

    def coords(self) -> tuple[int, int, int]:
        """(dp, pp, tp) index of this (member) rank in the stage's config."""
        if self.vllm is not None:
            return self.vllm.coords
        g = self.part.groups
        return g.dp_index, g.pp_index, g.tp_index

    def rows(self, batch_size: int) -> tuple[int, int]:
        """[lo, hi) of the batch rows this rank's replica handles."""
        d = self.coords()[0]
        sizes = [len(c) for c in torch.arange(batch_size).tensor_split(self.config.dp)]
        lo = sum(sizes[:d])
        return lo, lo + sizes[d]

    @property
    def reports(self) -> bool:
        """True on the one rank per replica that reports its rows (TP 0, PP 0)."""
        return self.member and self.coords()[1:] == (0, 0)


def build_stages(cfg: JobConfig, rank: int, device: torch.device | str = "cpu", keys=None) -> dict[str, ModelStage]:
    """Every model-stage of the plan (or those in ``keys``); groups for all, modules (on
    ``device``, weights uninitialised) where this rank belongs. Collective: every rank calls
    it with the same plan and keys (``new_group`` is collective over the world)."""
    stages = {}
    for key, sc in cfg.plan.stages().items():
        if keys is not None and key not in keys:
            continue
        args = model_args(cfg, key)
        config = sc.parallel_config(cfg.nproc)
        if key == ACTOR_GEN:  # the engine runs this plan (prepare.check_job checked it when loading)
            check_rollout_plan(sc, cfg.rollout.engine, spec=args.spec, world=cfg.nproc)
        if cfg.engine_owned(key):
            stages[key] = _vllm_stage(cfg, key, args, config, rank)
            continue
        groups = stage_groups(config, args.spec, rank)
        part = None
        if groups:
            gen = is_gen(key)  # the generator samples from gathered logits
            part = build_stage(args, config, rank, dp_shard=sc.dp_shard, device=device, groups=groups, vocab_parallel=not gen)
        train = is_train(key)
        stage = ModelStage(key=key, args=args, config=config, settings=sc, part=part)
        if key == ACTOR_GEN and part is not None:
            stage.engine = BuiltinEngine(part.module)
        stage.emus = derive_emus(args.spec, config, model=model_of(key), stage=stage_of(key), optimizer=train, dp_shard=sc.dp_shard)
        stage.group = _stage_group(config)
        if part is not None:
            stage.norm_weights = _norm_weights(stage, rank)
        stages[key] = stage
    return stages


def _stage_group(config: ParallelConfig) -> dist.ProcessGroup | None:
    """A group over the config's ranks, sorted (collective: every rank calls it for every
    stage); from ``parallel``'s one cache of groups."""
    if sorted(config.ranks) == list(range(dist.get_world_size())):
        return None
    return cached_group(tuple(sorted(config.ranks)))


def stage_group_ranks(stages: dict[str, ModelStage]) -> set[tuple[int, ...]]:
    """The rank tuples of every cached group the model-stages use (their own and their
    layouts' TP/PP/DP/KV/embed groups), from their configs: the same on every rank."""
    world = list(range(dist.get_world_size()))
    out: set[tuple[int, ...]] = set()
    for stage in stages.values():
        if sorted(stage.config.ranks) != world:
            out.add(tuple(sorted(stage.config.ranks)))
        if stage.vllm is None:
            out.update(r for ranks in plan_groups(stage.config, stage.args.spec).values() for r in ranks)
    return out


def _norm_weights(stage: ModelStage, rank: int) -> dict[str, float]:
    emu = next(e for e in stage.emus if rank in e.ranks)
    weights = {}
    for t in emu.tensors:
        for shard in t.shards:
            if shard.rank == rank:
                weights[t.name] = 1.0 / sum(1 for s in t.shards if s.box == shard.box)
    return weights


def _vllm_stage(cfg: JobConfig, key: str, args: ModelArgs, config: ParallelConfig, rank: int) -> ModelStage:
    """``actor.gen`` as a vLLM engine on every rank (vLLM's setup is collective over the world)."""
    stage = ModelStage(key=key, args=args, config=config, settings=cfg.plan.actor.gen, part=None)
    stage.emus = vllm_emus(args.spec, config, model=ACTOR, stage=GEN)
    stage.engine = VLLMEngine(
        args, config, rank=rank, seed=cfg.seed, model_path=cfg.model.path,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        max_num_seqs=-(-cfg.batch_size // config.dp),  # a replica's rows of a step (or of a validation chunk)
    )
    stage.group = _stage_group(config)
    return stage


def make_optimizer(stage: ModelStage, lr: float) -> None:
    """AdamW over the stage's parameters (foreach off: DTensor and plain tensors mix)."""
    if stage.part is not None:
        stage.optimizer = torch.optim.AdamW(stage.part.module.parameters(), lr=lr, weight_decay=0.0, foreach=False)
        optimizer_buffers(stage.part, stage.optimizer)  # state exists from the start: reshard/checkpoints see it


def gather_rows(stage: ModelStage, local: dict[str, torch.Tensor] | None, batch_size: int) -> dict[str, torch.Tensor]:
    """Every replica's rows, concatenated in row order, on every rank of the world (on CPU)."""
    mine = (stage.rows(batch_size)[0], {k: v.cpu() for k, v in local.items()}) if stage.reports else None
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    pieces = sorted((p for p in parts if p is not None), key=lambda p: p[0])
    return {k: torch.cat([p[1][k] for p in pieces]) for k in pieces[0][1]}


def response_logprobs(
    logits: torch.Tensor, mb: dict[str, torch.Tensor], temperature: float, vocab: VocabShard = VocabShard(), *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(a_t | s_t) of the response tokens [B, N] (logits at positions P-1..T-2 score
    tokens P..T-1) and, with ``entropy``, H(π(· | s_t)) there, of the distribution sampled
    from (logits / T). ``logits`` are this rank's vocabulary columns (``vocab``): [B, T, V_t],
    or one pack's [1, width, V_t] when ``mb`` carries ``score_pos`` (``trainer/parallel/packing.py``)."""
    p = int(mb["prompt_width"][0])
    targets = mb["input_ids"][:, p:]
    if "score_pos" in mb and "response_mask" in mb:  # a pack: only its real response tokens, never [rows, N, V]
        real = mb["response_mask"].bool()
        logits = upcast(logits[0][mb["score_pos"][real]])[None]
        lp, ent = token_logprobs(logits if temperature == 1.0 else logits / temperature, targets[real][None], vocab, entropy=entropy)
        return _scatter(lp[0], real), None if ent is None else _scatter(ent[0], real)
    return token_logprobs(_response_logits(logits, mb, temperature), targets, vocab, entropy=entropy)


def _scatter(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``values`` [n] at the True places of ``where`` [B, N], 0 elsewhere (differentiable)."""
    return torch.zeros(where.shape, dtype=values.dtype, device=values.device).masked_scatter(where, values)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 at least: 16-bit outputs are upcast, float32 and float64 stay."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _scoring(out: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """``out`` [B, T, …] at positions P-1..T-2, which score the response tokens: a slice, or
    gathered from one pack's output [1, width, …] at the rows' ``score_pos``."""
    if "score_pos" in mb:
        return out[0][mb["score_pos"]]
    return out[:, int(mb["prompt_width"][0]) - 1 : -1]


def _response_logits(logits: torch.Tensor, mb: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """The logits [B, N, V_t] that score the response tokens, in float32 (at least) and
    divided by the temperature (no copy of the block at T = 1 in float32)."""
    logits = upcast(_scoring(logits, mb))
    return logits if temperature == 1.0 else logits / temperature


def response_values(values: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """V(s_t) for each response token: the value at the position before it."""
    return upcast(_scoring(values, mb))


def sequence_scores(values: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """A reward model's score of each sequence [B]: its value at the sequence's last real
    token (HF's ``*ForSequenceClassification`` pooling; rows are left-padded prompts
    followed by right-padded responses)."""
    if "last_pos" in mb:
        return upcast(values[0][mb["last_pos"]])
    real = mb["attention_mask"].bool()
    last = (real.long() * torch.arange(real.shape[1], device=real.device)).argmax(1)
    return upcast(values).gather(1, last[:, None]).squeeze(1)


def infer(stage: ModelStage, batch: dict[str, torch.Tensor], what: str, temperature: float = 1.0) -> torch.Tensor:
    """Per row, computed by the stage's replicas: ``what="logprobs"`` [B, N] of the response
    tokens, ``"values"`` [B, N] before each response token, or ``"scores"`` [B], a reward
    model's score of the whole sequence."""
    b = batch["input_ids"].shape[0]
    budget = stage.settings.micro_batch_tokens
    order = _balanced(stage, batch) if budget else None
    batch = batch if order is None else {k: v[order] for k, v in batch.items()}
    local = None
    if stage.member:
        lo, hi = stage.rows(b)
        mine = _my_rows(stage, batch, lo, hi)
        vocab = stage.part.vocab
        if budget:
            local = {"out": _infer_packed(stage, batch, mine, what, temperature, budget)}
        else:
            fn = {
                "logprobs": lambda out, mb: response_logprobs(out, mb, temperature, vocab)[0],
                "values": response_values,
                "scores": sequence_scores,
            }[what]
            local = {"out": forward(stage.part, mine, n_microbatches=_microbatches(stage, hi - lo), output_fn=fn)}
    out = gather_rows(stage, local, b)["out"]
    return out if order is None else out[torch.argsort(order)]


def _balanced(stage: ModelStage, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The rows in the order that deals the replicas equal token counts (``balanced_order``;
    the same on every rank: it depends on the batch only)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    return torch.tensor(balanced_order(lengths, stage.config.dp), dtype=torch.long)


def _pack(stage: ModelStage, batch: dict[str, torch.Tensor], mine: dict[str, torch.Tensor], budget: int) -> Packing:
    """This replica's rows ``mine`` of ``batch`` in packs of at most ``budget`` tokens. Under
    FSDP2 every replica makes as many packs as the one that needs most (each pack's forward
    and backward all-gather the weights over dp: unequal counts would hang), and a pipeline
    gets at least pp micro-batches where the rows allow. Every rank holds the whole batch, so
    each computes every replica's count itself, with no collective."""
    count, rows = None, mine["input_ids"].shape[0]
    if stage.dp_shard and stage.config.dp > 1:
        lengths = batch["attention_mask"].sum(1).tolist()
        shares = torch.arange(len(lengths)).tensor_split(stage.config.dp)
        count = max(pack_count([lengths[i] for i in share.tolist()], budget) for share in shares)
    if stage.config.pp > 1:
        count = max(count or 1, min(stage.config.pp, rows))
    return pack_batch(mine, budget, count)


def _infer_packed(stage: ModelStage, batch: dict[str, torch.Tensor], mine: dict[str, torch.Tensor], what: str, temperature: float,
                  budget: int) -> torch.Tensor:
    """``infer`` of this replica's rows over packs of at most ``budget`` tokens: the output
    functions run on each pack's positions (pipelining needs per-pack shapes) and
    ``Packing.unpack`` takes each row's values back to the padded layout."""
    packing = _pack(stage, batch, mine, budget)
    extra: dict[str, torch.Tensor] = {}
    if what == "logprobs":
        ids = packing.input_ids
        scored = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        scored[packing.pack_of[:, None].expand_as(packing.score_pos), packing.score_pos] = True
        extra = {"next_ids": torch.roll(ids, -1, dims=1), "scored": scored}
        vocab = stage.part.vocab

        def fn(out: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
            at = mb["scored"]
            logits = upcast(out[at])[None]
            logits = logits if temperature == 1.0 else logits / temperature
            lp = token_logprobs(logits, mb["next_ids"][at][None], vocab)[0][0]
            return torch.zeros(at.shape, dtype=lp.dtype, device=lp.device).masked_scatter_(at, lp)
    else:
        def fn(out: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
            return upcast(out)
    packed = forward(stage.part, extra, output_fn=fn, packing=packing)
    return packing.unpack(packed, at="last" if what == "scores" else "score")


@dataclass(kw_only=True)
class Backward:
    """One model-stage's forward and backward of one mini-batch on this rank, before its
    optimizer step (which ``loop.Trainer`` takes only once every rank's is finite)."""

    sums: LossSums | None
    """The loss statistics of this replica's rows (on the one rank per replica that
    computes them: last PP stage, TP rank 0; None elsewhere)."""
    grad_norm: torch.Tensor
    """The model-stage's global gradient norm, before clipping (the same on all its ranks)."""
    finite: bool


def backward_minibatch(stage: ModelStage, batch: dict[str, torch.Tensor], loss_fn, max_grad_norm: float) -> Backward | None:
    """Gradients of the mini-batch's loss (its replica's rows of it, every micro-batch),
    summed over dp and clipped to ``max_grad_norm``; no optimizer step. ``loss_fn(output,
    micro_batch) -> (loss, LossSums)`` with the loss normalised by the whole mini-batch
    (``batch["loss_weights"]``). None off the stage's ranks."""
    if not stage.member:
        return None
    budget = stage.settings.micro_batch_tokens
    if budget:  # the replicas' shares balanced by tokens: every row's loss is normalised globally
        order = _balanced(stage, batch)
        batch = {k: v[order] for k, v in batch.items()}
    lo, hi = stage.rows(batch["input_ids"].shape[0])
    mine = _my_rows(stage, batch, lo, hi)
    mine["row_index"] = torch.arange(lo, hi, device=stage.part.device)
    set_recompute(stage.part.module, stage.settings.recompute)
    # Keyed by each micro-batch's first row, the last call per key kept: torch's pipelining
    # (2.13) calls the loss once more, FIRST, while it infers the backward's metadata — on
    # placeholder activations (torch.empty), so its statistics are garbage; the real call of
    # that micro-batch comes later and replaces them. (The loss must therefore not assert on
    # its values; the trainer's finiteness check runs after the schedule, on what it returns.)
    collected: dict[int, LossSums] = {}

    def fn(out, mb):
        loss, sums = loss_fn(out, mb)
        collected[int(mb["row_index"][0])] = sums
        return loss

    stage.optimizer.zero_grad(set_to_none=False)
    packing = _pack(stage, batch, mine, budget) if budget else None
    loss = forward_backward(stage.part, mine, fn, n_microbatches=_microbatches(stage, hi - lo), packing=packing)
    grad_norm = clip_grads(stage, max_grad_norm)
    reports = bool(collected) and stage.coords()[2] == 0  # loss_fn runs on the last PP stage only
    parts = [collected[k] for k in sorted(collected)]
    return Backward(
        sums=sum(parts[1:], parts[0]) if reports else None,
        grad_norm=grad_norm,
        finite=bool(torch.isfinite(loss) & torch.isfinite(grad_norm)),
    )


def clip_grads(stage: ModelStage, max_norm: float) -> torch.Tensor:
    """Clip to the global gradient norm of the model-stage, computed from the layouts.

    ‖g‖² = Σ over distinct boxes of the box's Σ g². Each rank adds Σ g² of its local
    gradients weighted by 1 / (holders of that box in its EMU) — TP-replicated norms, KV
    heads copied over TP ranks and the tied embedding's last-stage copy count once — and
    the sum runs over the stage's ranks; replicated dp replicas hold equal gradients, so
    their total is divided by dp (dp-sharded state is one EMU, counted once).
    """
    grads = stage_grads(stage.part)
    sq = torch.zeros((), dtype=torch.float64, device=stage.part.device)
    for name, g in grads.items():
        sq += g.double().pow(2).sum() * stage.norm_weights[name]
    dist.all_reduce(sq, group=stage.group)
    if not stage.dp_shard:
        sq /= stage.config.dp
    norm = sq.sqrt().float()
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (float(norm) + 1e-6)
        for g in grads.values():
            g.mul_(scale)
    return norm


def _my_rows(stage: ModelStage, batch: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Rows [lo, hi) of every batch tensor, on the stage's device."""
    return {k: v[lo:hi].to(stage.part.device) for k, v in batch.items()}


def _microbatches(stage: ModelStage, rows: int) -> int:
    """Micro-batches for a replica's ``rows``: ``StageConfig.micro_batches``."""
    return stage.settings.micro_batches(rows)
