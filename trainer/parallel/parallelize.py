"""Apply a parallel config (dp, tp, pp on global ranks) to one model-stage of a Decoder.

Build order (torchtitan's): ``build_model`` on ``meta`` -> keep this rank's pipeline stage ->
TP (DTensor ``parallelize_module``, the plan is data: module name -> ParallelStyle) ->
FSDP2 over dp when ``dp_shard`` -> ``to_empty(device)`` -> load (``load_full``,
``init_stage``, or reshard writing into ``stage_buffers``).

The local tensors match ``reshard.derive.derive_emus`` exactly (checked at build time):

- vocab-parallel ``embed_tokens`` / ``lm_head``: rows ``vocab_range(V, tp, t)`` on TP rank t,
  ``torch.chunk`` pieces of ceil(V/tp) rows, the last shorter or empty (DTensor ``Shard(0)``,
  uneven: no padded rows, so nothing to mask; ``docs/vocab.md``). ``ColwiseParallel`` shards
  the lm head so; the embedding is ``VocabParallelEmbedding`` (Megatron's: look up the local
  rows, zeros elsewhere, all-reduce), since DTensor's own ``RowwiseParallel`` embedding fails
  on a rank whose shard is empty. Training and inference stages keep
  the logits sharded too: the model returns this rank's vocabulary columns [.., V_t] and
  ``vocab_parallel`` computes log-probs, entropy and losses from them
  (``StagePart.vocab``), so no rank holds full-vocabulary logits. Generation
  (``vocab_parallel=False``) all-gathers its one position's logits, to sample from them;
- q/gate/up (and q/k/v biases) column-parallel, o/down row-parallel (dim 1);
- k/v: split by KV head when tp divides the KV heads. With GQA and tp > kv, TP rank t
  holds the whole KV head ``t // (tp / kv)`` (vLLM's replication), which a DTensor placement
  on the TP mesh cannot express: those projections stay plain ``nn.Linear`` holding one head
  (``ReplicatedKVHead``). Their input gradient is all-reduced over the TP group in backward
  (Megatron's "f": identity forward, sum backward), and their weight gradient, computed by
  each copy from its own query heads only, is summed over the tp / kv copies by
  ``pipeline.sync_grads``: d/dW_k = sum over copies of x^T dL/dk_copy;
- norms and the value head: replicated plain tensors (their gradients are identical on
  every TP rank because every activation gradient reaching them has been all-reduced);
- tied embeddings (lm head): the output projection ``F.linear(h, embed.weight)`` needs ``h``
  as a Replicate DTensor (the final norm's output is annotated so); the vocab-sharded
  logits leave as their local shard (or gathered, for generation). With pp > 1 the last stage holds a copy of
  ``embed_tokens``; ``sync_grads`` sums the two copies' gradients (Megatron's embedding group).
- ``dp_shard``: FSDP2 ``fully_shard`` per layer and on the root over the dp mesh: each TP-local
  tensor is split along dim 0 in ``torch.chunk`` pieces over dp, as derive lays it out. FSDP2
  works on CPU/gloo here (torch 2.13), TP and FSDP sharing one (dp, pp, tp) DeviceMesh.
  Without ``dp_shard``, dp replicas hold full copies and ``sync_grads`` sums gradients
  over the dp group (one flat all-reduce per group after the last micro-batch, instead of
  DDP's buckets overlapped with backward). Gradients are SUMMED over dp, never averaged —
  FSDP2's reduce-scatter too (divide factor 1): every loss is already normalised by the
  global mini-batch (``trainer/algos/ppo.py``, "Aggregation").
- mixed precision: a stage whose ``args.compute`` differs from its storage dtype (fp32
  master weights, bf16 compute) casts on use inside the model (``trainer/models/decoder.py``); under
  FSDP2 ``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)`` all-gathers the
  weights in the compute dtype instead. Gradients are float32 and reduced in float32.

Process groups: ``trainer/parallel/groups.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)

from nereus.reshard.derive import DecoderSpec, check_tp, derive_emus, plan_layer_ranges, vocab_range
from nereus.reshard.errors import LayoutError, ProcessGroupError
from nereus.reshard.layout import DTYPES, ParallelConfig, TensorLayout, box_view, local_buffers

from ..models.decoder import Decoder, ModelArgs, build_model, init_tensor
from .groups import StageGroups, groups_cached, stage_groups, tied_copy
from .vocab_parallel import VocabShard


# ------------------------------------------------------------------------ pipeline cut


def plan_stage_modules(spec: DecoderSpec, pp: int) -> list[list[str]]:
    """Module names each pipeline stage keeps (pure; torchtitan's fqn-per-model-part).

    Layers split by ``plan_layer_ranges``; the first stage keeps ``model.embed_tokens``, the
    last ``model.norm`` and ``lm_head``/``score``, and with a tied lm head and pp > 1 also a
    copy of ``model.embed_tokens`` (as ``reshard.derive`` lays it out).
    """
    stages = []
    for p, layers in enumerate(plan_layer_ranges(spec.num_layers, pp)):
        keep = [f"model.layers.{i}" for i in layers]
        if p == 0 or (p == pp - 1 and tied_copy(spec, pp)):
            keep.insert(0, "model.embed_tokens")
        if p == pp - 1:
            keep.append("model.norm")
            if spec.head == "value":
                keep.append("score")
            elif not spec.tie_embeddings:
                keep.append("lm_head")
        stages.append(keep)
    return stages


def apply_stage_cut(model: Decoder, keep: Iterable[str]) -> None:
    """Drop every layer, embedding, norm and head not named in ``keep`` (in place)."""
    keep = set(keep)
    for name in list(model.model.layers.keys()):
        if f"model.layers.{name}" not in keep:
            del model.model.layers[name]
    for owner, attr, name in ((model.model, "embed_tokens", "model.embed_tokens"), (model.model, "norm", "model.norm"),
                              (model, "lm_head", "lm_head"), (model, "score", "score")):
        if name not in keep:
            setattr(owner, attr, None)


# ------------------------------------------------------------------------ tensor parallel


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReplicatedKVHead(ParallelStyle):
    """k/v projection when tp > num_kv_heads: a plain Linear holding ONE KV head (head_dim rows).

    Which head (``t // (tp / kv)``) is decided by what is loaded into it (derive's layout); the
    module only shrinks to one head. The input gradient is summed over the TP group in backward;
    the weight gradient over the head's copies is summed by ``sync_grads``.
    """

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"ReplicatedKVHead applies to nn.Linear, got {type(module).__name__}")
        w = module.weight
        module.weight = nn.Parameter(torch.empty(self.head_dim, w.shape[1], dtype=w.dtype, device=w.device))
        if module.bias is not None:
            module.bias = nn.Parameter(torch.empty(self.head_dim, dtype=w.dtype, device=w.device))
        module.out_features = self.head_dim
        group = device_mesh.get_group()
        module.register_forward_pre_hook(lambda _m, args: (_SumGradOverGroup.apply(args[0], group), *args[1:]))
        return module


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward over ``group``, identity backward (Megatron's "g"): the
    upstream gradient is already the same on every rank of the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)  # the input stays as autograd saw it
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class VocabParallelEmbedding(ParallelStyle):
    """An Embedding whose rows are split over the TP mesh in ``torch.chunk`` pieces (a
    ``Shard(0)`` DTensor weight, as derive lays it out: ``vocab_range``, the last pieces
    shorter or empty), looked up as Megatron's VocabParallelEmbedding: ids in this rank's
    range read its rows, the others give zeros, and the TP group sums (each id is in exactly
    one range, so the sum is that row exactly). Forward all-reduce, identity backward; the
    weight's gradient is the local rows' own (``Shard(0)``). The lookup runs in the module's
    ``compute`` dtype when it has one (``models.decoder.Embedding``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding applies to nn.Embedding, got {type(module).__name__}")
        w = module.weight
        module.weight = nn.Parameter(distribute_tensor(w, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                                     requires_grad=w.requires_grad)
        start, _ = vocab_range(module.num_embeddings, device_mesh.size(), device_mesh.get_local_rank())
        group = device_mesh.get_group()

        def forward(ids: torch.Tensor) -> torch.Tensor:
            weight = module.weight
            weight = weight.to_local() if isinstance(weight, DTensor) else weight
            weight = weight.to(getattr(module, "compute", weight.dtype))
            rows = weight.shape[0]
            if rows == 0:  # an empty shard: no id is here
                out = weight.new_zeros(*ids.shape, weight.shape[1])
            else:
                local = ids - start
                outside = (local < 0) | (local >= rows)
                out = F.embedding(local.clamp(0, rows - 1), weight).masked_fill(outside[..., None], 0.0)
            return _SumOverGroup.apply(out, group)

        module.forward = forward
        return module


class GatherOutput(ParallelStyle):
    """Turn a DTensor module output into the full plain tensor (differentiable all-gather),
    or with ``local=True`` into this rank's shard of it; plain outputs pass through. Used on
    the root for tied-embedding logits."""

    def __init__(self, *, local: bool = False) -> None:
        super().__init__()
        self.local = local

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_m, _a, out):
            if not isinstance(out, DTensor):
                return out
            return out.to_local() if self.local else out.full_tensor()

        module.register_forward_hook(hook)
        return module


def plan_tp(spec: DecoderSpec, tp: int, *, vocab_parallel: bool = True) -> dict[str, ParallelStyle]:
    """The TP plan of a whole Decoder: module name (``*`` = every layer) -> ParallelStyle.

    ``vocab_parallel``: the logits leave sharded over the vocabulary (this rank's columns);
    False gathers them (generation samples from the whole distribution)."""
    check_tp(spec, tp)
    kv = ColwiseParallel() if spec.num_kv_heads % tp == 0 else ReplicatedKVHead(spec.dim_head)
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": VocabParallelEmbedding(),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": kv,
        "model.layers.*.self_attn.v_proj": kv,
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
    }
    if spec.head == "lm" and spec.tie_embeddings:
        plan["model.norm"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False
        )
        plan[""] = GatherOutput(local=vocab_parallel)
    elif spec.head == "lm":
        plan["lm_head"] = ColwiseParallel() if vocab_parallel else ColwiseParallel(output_layouts=Replicate())
    return plan


def apply_tp(model: Decoder, mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]) -> None:
    """``parallelize_module`` with the entries whose module this stage holds (no comms: the
    weights are on meta and ``src_data_rank=None`` keeps each rank's local data)."""
    present = {name for name, _ in model.named_modules()}
    kept = {
        key: style
        for key, style in plan.items()
        if key == "" or key in present or ("*" in key and any(_matches(key, name) for name in present))
    }
    parallelize_module(model, mesh, kept, src_data_rank=None)


def _matches(pattern: str, name: str) -> bool:
    a, b = pattern.split("."), name.split(".")
    return len(a) == len(b) and all(x == "*" or x == y for x, y in zip(a, b))


# ------------------------------------------------------------------------ the stage


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePart:
    """One rank's part of a model-stage: its pipeline stage of the Decoder, parallelized."""

    args: ModelArgs
    config: ParallelConfig
    groups: StageGroups
    module: Decoder
    dp_shard: bool
    device: torch.device
    vocab_parallel: bool = True

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def stage(self) -> int:
        return self.groups.pp_index

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.config.pp - 1

    @property
    def fsdp(self) -> bool:
        return self.dp_shard and self.config.dp > 1

    @property
    def vocab(self) -> VocabShard:
        """Where this rank's logits sit in the vocabulary (all of it unless TP-sharded)."""
        spec = self.args.spec
        if not self.vocab_parallel or self.config.tp == 1 or spec.head != "lm":
            return VocabShard()
        return VocabShard(start=vocab_range(spec.vocab_size, self.config.tp, self.groups.tp_index)[0], group=self.groups.tp)

    def layouts(self) -> list[TensorLayout]:
        """derive's parameter layouts of the EMU this rank belongs to."""
        emus = derive_emus(self.args.spec, self.config, model="m", stage="s", dp_shard=self.dp_shard)
        return list(emus[0 if self.dp_shard else self.groups.dp_index].tensors)


def build_stage(
    args: ModelArgs,
    config: ParallelConfig,
    rank: int | None = None,
    *,
    dp_shard: bool = False,
    device: torch.device | str = "cpu",
    groups: StageGroups | None = None,
    vocab_parallel: bool = True,
) -> StagePart:
    """This rank's stage of the model under ``config``, parallelized, weights uninitialised.

    ``vocab_parallel=False`` gathers the logits over TP (generation); see the module docstring.

    ``groups`` defaults to ``stage_groups(config, spec)``, which is only safe here when the
    config spans the whole world or its groups were created before by every rank; otherwise
    ProcessGroupError. Raises LayoutError if the local tensors do not match derive's layout.
    """
    spec = args.spec
    rank = dist.get_rank() if rank is None else rank
    if rank not in config.ranks:
        raise ProcessGroupError(f"rank {rank} is not in the parallel config's ranks {config.ranks}")
    check_tp(spec, config.tp)
    if groups is None:
        if set(config.ranks) != set(range(dist.get_world_size())) and not groups_cached(config, spec):
            raise ProcessGroupError(
                f"config {config.describe()} on ranks {config.ranks} spans part of the world: call "
                "stage_groups(config, spec) on every rank first (new_group is collective over the world)"
            )
        groups = stage_groups(config, spec, rank)
    device = torch.device(device)
    model = build_model(args, "meta")
    apply_stage_cut(model, plan_stage_modules(spec, config.pp)[groups.pp_index])
    mesh = groups.mesh(device.type)
    if config.tp > 1:
        apply_tp(model, mesh["tp"], plan_tp(spec, config.tp, vocab_parallel=vocab_parallel))
    if dp_shard and config.dp > 1:
        apply_fsdp(model, mesh["dp"], args)
    model.to_empty(device=device)
    part = StagePart(
        args=args, config=config, groups=groups, module=model, dp_shard=dp_shard, device=device, vocab_parallel=vocab_parallel
    )
    check_buffers(part)
    return part


def apply_fsdp(model: Decoder, mesh: DeviceMesh, args: ModelArgs) -> None:
    """FSDP2 per layer and on the root over the dp mesh: gradients summed (divide factor 1),
    and, when the model computes in another dtype than it stores, the weights all-gathered
    in the compute dtype with float32 gradient reduction."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if args.compute != args.spec.dtype:
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[args.compute], reduce_dtype=torch.float32)
    for layer in model.model.layers.values():
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for m in model.modules():
        if isinstance(m, FSDPModule):  # a plain SUM (gloo has no PREMUL_SUM), no division after it
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


# ------------------------------------------------------------------------ local tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor sharing ``t``'s storage (DTensor -> its local shard)."""
    with torch.no_grad():
        return t.to_local() if isinstance(t, DTensor) else t.detach()


def reshard(part: StagePart) -> None:
    """Register the sharded parameters again (FSDP2's root keeps the gathered ones after a
    forward that no backward followed, e.g. inference); a no-op without FSDP."""
    if part.fsdp:
        from torch.distributed.fsdp import FSDPModule

        for m in part.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def stage_buffers(part: StagePart) -> dict[str, torch.Tensor]:
    """HF name -> the rank-local tensor of every parameter, a VIEW of its storage.

    Writes into these land in the live parameters, so reshard executors can use them as
    src/dst buffers. Keys, shapes and dtypes equal ``local_buffers(emu.tensors, rank)`` of
    derive's EMU (``dp_shard`` chunks that are empty on this rank are left out, as derive does).
    With FSDP2 the views are of the sharded parameters (``reshard`` first): take them again
    after anything that re-registers parameters, and write only between steps.
    """
    reshard(part)
    out = {}
    for name, p in part.module.named_parameters():
        local = _local(p)
        if local.numel() or local.dim() == 0:
            out[name] = local
    return out


def stage_grads(part: StagePart) -> dict[str, torch.Tensor]:
    """HF name -> the rank-local gradient, laid out like ``stage_buffers``.

    A missing gradient becomes zeros. A DTensor gradient placed unlike its parameter is
    redistributed to the parameter's placements first (DTensor's embedding backward returns
    a Replicate gradient for a Shard(0) weight: slicing it is local)."""
    out = {}
    for name, p in part.module.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif isinstance(p, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        local = _local(p.grad)
        if local.numel() or local.dim() == 0:
            out[name] = local
    return out


def check_buffers(part: StagePart) -> None:
    """Raise LayoutError unless ``stage_buffers`` matches derive's local buffers exactly."""
    want = local_buffers(part.layouts(), part.rank)
    have = stage_buffers(part)
    for name in sorted(set(want) | set(have)):
        w, h = want.get(name), have.get(name)
        if w is None or h is None or tuple(h.shape) != w.shape or str(h.dtype).removeprefix("torch.") != w.dtype:
            got = None if h is None else (tuple(h.shape), h.dtype)
            raise LayoutError(
                f"rank {part.rank} ({part.config.describe()}): parameter {name!r} holds {got}, "
                f"derive's layout expects {None if w is None else (w.shape, w.dtype)}"
            )


@torch.no_grad()
def load_full(part: StagePart, full: Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor]) -> None:
    """Copy this rank's box of every full tensor (name -> tensor, or a function of the name)
    into the stage's parameters, boxes taken from derive's layout."""
    get = full if callable(full) else full.__getitem__
    buffers = stage_buffers(part)
    for layout in part.layouts():
        for shard in layout.shards:
            if shard.rank == part.rank:
                buffers[layout.name].copy_(box_view(get(layout.name), shard.offsets, shard.lengths))


def init_stage(part: StagePart, seed: int = 0, std: float = 0.02) -> None:
    """The values ``decoder.init_weights(full_model, seed, std)`` gives, for this rank's boxes:
    each full tensor drawn alone (``decoder.init_tensor``; one parameter's memory at a time)."""
    shapes = {t.name: t.shape for t in part.layouts()}
    load_full(part, lambda name: init_tensor(name, shapes[name], seed, std))


# ------------------------------------------------------------------------ optimizer state


def optimizer_buffers(part: StagePart, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW state as derive names it (``optim/exp_avg/<p>``, ``optim/exp_avg_sq/<p>``,
    ``optim/step/<p>``), rank-local views; state not created yet is created as zeros, exactly
    what AdamW's first step would create, so a reshard can write into it before any step."""
    out = {}
    params = {id(p): name for name, p in part.module.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = params[id(p)]
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if _local(p).numel() == 0 and p.dim() > 0:
                continue
            out[f"optim/exp_avg/{name}"] = _local(state["exp_avg"])
            out[f"optim/exp_avg_sq/{name}"] = _local(state["exp_avg_sq"])
            out[f"optim/step/{name}"] = _local(state["step"])
    return out

