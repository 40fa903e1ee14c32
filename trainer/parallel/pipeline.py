"""Forward, and forward + backward, of one model-stage over micro-batches, with or without PP.

Contract (SPMD): every rank of a model replica (all its TP and PP ranks) calls with the SAME
``batch``: a dict of tensors sharing the leading batch dim B, holding ``input_ids`` [B, T]
and optionally ``attention_mask``/``position_ids`` (passed to the model) plus whatever the
loss needs (advantages, old log-probs, masks...). Different dp replicas get their own share.

Micro-batches are ``torch.tensor_split(t, n)`` of every tensor along dim 0 (B >= n; with
pp > 1, n must divide B: pipelining sizes its activation buffers once, from the first
micro-batch). ``loss_fn(output, micro_batch) -> scalar`` is called once per
micro-batch on the last stage; the gradient is that of the SUM of these losses (no
1/n scaling: normalise inside ``loss_fn`` by the GLOBAL mini-batch, ``trainer/algos/ppo.py``'s
aggregation), then ``sync_grads`` finishes it (KV-head copies, tied embedding copies, the
sum over dp replicas). Each call
runs one optimizer step's worth of micro-batches: zero the gradients between steps.

pp > 1 runs ``torch.distributed.pipelining``: a ``PipelineStage`` over the PP group
(``Schedule1F1B`` when n >= pp, else ``ScheduleGPipe``), built anew per call, so sequence
lengths may change between calls (the stage re-infers activation shapes, one small metadata
exchange). The loss sees its micro-batch's extra tensors through the schedule's ``target``:
the row indices ``arange(B)``, split like the inputs, select the rows of ``batch``. Model
kwargs reach every stage (pipelining passes kwargs to each stage's forward). pp == 1 is a
plain loop over micro-batches (FSDP2 gradient sync only after the last one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from .packing import Packing
from .parallelize import StagePart, reshard, stage_grads

MODEL_KWARGS = ("attention_mask", "position_ids", "document_ids")
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
OutputFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def _all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum ``tensors`` over ``group`` in one flat all-reduce, in place."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def sync_grads(part: StagePart) -> None:
    """Finish the gradients after the last micro-batch's backward (``forward_backward`` calls it).

    1. KV-head copies (tp > kv): sum over each head's copies.
    2. Tied embedding copies (pp > 1): sum over the first and last stage.
    3. Replicated dp: sum over the dp group (FSDP2 has already reduce-scattered, summing):
       each replica's loss is its share of the global mini-batch's loss, so the sum is the
       gradient of that loss.
    The three are linear maps on disjoint or commuting index sets, so their order is free.
    Every rank of a group calls this with the same parameter set, so flat sizes agree.
    """
    grads = stage_grads(part)
    c, g = part.config, part.groups
    if g.kv is not None:
        names = [n for n in grads if ".self_attn.k_proj." in n or ".self_attn.v_proj." in n]
        _all_reduce_flat([grads[n] for n in names], g.kv)
    if g.embed is not None and "model.embed_tokens.weight" in grads:
        _all_reduce_flat([grads["model.embed_tokens.weight"]], g.embed)
    if c.dp > 1 and not part.fsdp:
        _all_reduce_flat(list(grads.values()), g.dp)


def split_batch(batch: Mapping[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """The n micro-batches of ``batch``: ``tensor_split`` of every tensor along dim 0."""
    parts = {k: torch.tensor_split(v, n) for k, v in batch.items()}
    return [{k: parts[k][i] for k in batch} for i in range(n)]


def _check_batch(batch: Mapping[str, torch.Tensor], n: int, pp: int) -> int:
    if "input_ids" not in batch:
        raise KeyError(f"batch needs 'input_ids'; it has {sorted(batch)}")
    b = batch["input_ids"].shape[0]
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != b:
            raise ValueError(f"batch[{key!r}] must be a tensor with leading dim B={b}")
    if not 1 <= n <= b:
        raise ValueError(f"n_microbatches={n} must lie in [1, B={b}]")
    if pp > 1 and b % n:
        raise ValueError(f"with pp={pp}, n_microbatches={n} must divide the batch size B={b} (equal micro-batches)")
    return b


def _model_kwargs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in MODEL_KWARGS if k in batch}


def _broadcast_from_last(part: StagePart, value: torch.Tensor | None) -> torch.Tensor:
    """``value`` of the last PP stage on every rank of this PP group (shape sent first)."""
    group, src = part.groups.pp, part.config.pp - 1
    meta = [(tuple(value.shape), value.dtype) if part.is_last else None]
    dist.broadcast_object_list(meta, group=group, group_src=src)
    shape, dtype = meta[0]
    out = value.contiguous() if part.is_last else torch.empty(shape, dtype=dtype, device=part.device)
    dist.broadcast(out, group=group, group_src=src)
    return out


def forward_backward(
    part: StagePart,
    batch: Mapping[str, torch.Tensor],
    loss_fn: LossFn,
    n_microbatches: int = 1,
    *,
    sync: bool = True,
    packing: Packing | None = None,
) -> torch.Tensor:
    """One training step's forward and backward: gradients of sum_m loss_fn(out_m, batch_m)
    added to ``.grad`` and, with ``sync``, finished by ``sync_grads`` (ready for
    ``optimizer.step()``); returns that sum (float32, 0-d, detached) on every rank of the
    replica. To accumulate over several calls, pass ``sync=False`` and call ``sync_grads``
    once after the last: its KV-copy and tied-embedding sums must run once per step.

    With ``packing`` (``trainer/parallel/packing.py``) micro-batch m is pack m: the model runs on the
    pack (as wide as its tokens; with pp > 1 every pack as wide as the widest) and
    ``loss_fn`` gets its output [1, width, …] with ``packing.rows_of(batch, m)``, the pack's
    rows in the padded layout (``n_microbatches`` is ignored)."""
    if packing is not None:
        return _forward_backward_packed(part, batch, loss_fn, packing, sync=sync)
    b = _check_batch(batch, n_microbatches, part.config.pp)
    model, n = part.module, n_microbatches
    if part.config.pp == 1:
        total = torch.zeros((), dtype=torch.float32, device=part.device)
        for i, mb in enumerate(split_batch(batch, n)):
            if part.fsdp:
                model.set_requires_gradient_sync(i == n - 1)
            loss = loss_fn(model(mb["input_ids"], **_model_kwargs(mb)), mb)
            loss.backward()
            total += loss.detach().float()
    else:
        def mb_loss(output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            return loss_fn(output, {k: v[lo:hi] for k, v in batch.items()})

        stage = PipelineStage(model, part.stage, part.config.pp, part.device, group=part.groups.pp)
        schedule_cls = Schedule1F1B if n >= part.config.pp else ScheduleGPipe
        schedule = schedule_cls(stage, n, loss_fn=mb_loss, scale_grads=False)
        args = (batch["input_ids"],) if part.is_first else ()
        losses: list[torch.Tensor] = []
        rows = torch.arange(b, device=batch["input_ids"].device)
        with _keep_fsdp_grads(part):
            schedule.step(*args, target=rows, losses=losses, return_outputs=False, **_model_kwargs(batch))
        total = torch.stack([x.detach().float() for x in losses]).sum() if part.is_last else None
        total = _broadcast_from_last(part, total)
    if sync:
        sync_grads(part)
    return total


def _forward_backward_packed(part: StagePart, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, packing: Packing, *, sync: bool) -> torch.Tensor:
    """``forward_backward`` over the packs of ``packing``, one micro-batch each."""
    model, n = part.module, len(packing.packs)
    if part.config.pp == 1:
        total = torch.zeros((), dtype=torch.float32, device=part.device)
        for m in range(n):
            if part.fsdp:
                model.set_requires_gradient_sync(m == n - 1)
            inputs = packing.model_inputs(m)
            loss = loss_fn(model(inputs.pop("input_ids"), **inputs), packing.rows_of(batch, m))
            loss.backward()
            total += loss.detach().float()
    else:
        def mb_loss(output: torch.Tensor, pack: torch.Tensor) -> torch.Tensor:
            return loss_fn(output, packing.rows_of(batch, int(pack[0])))

        stage = PipelineStage(model, part.stage, part.config.pp, part.device, group=part.groups.pp)
        schedule_cls = Schedule1F1B if n >= part.config.pp else ScheduleGPipe
        schedule = schedule_cls(stage, n, loss_fn=mb_loss, scale_grads=False)
        inputs = packing.model_inputs()
        ids = inputs.pop("input_ids")
        losses: list[torch.Tensor] = []
        with _keep_fsdp_grads(part):
            schedule.step(*((ids,) if part.is_first else ()), target=torch.arange(n, device=ids.device), losses=losses,
                          return_outputs=False, **inputs)
        total = torch.stack([x.detach().float() for x in losses]).sum() if part.is_last else None
        total = _broadcast_from_last(part, total)
    if sync:
        sync_grads(part)
    return total


@contextmanager
def _keep_fsdp_grads(part: StagePart):
    """Gradients from earlier calls survive a pipelined call with FSDP2.

    Building a PipelineStage runs metadata inference, whose cleanup sets ``.grad = None`` on
    every parameter of an FSDP module (torch 2.13), wiping gradients a pending optimizer step
    still needs (an inference pass between backward and step, or accumulation over calls).
    Stash them, run, then add them back to what this call produced."""
    if not (part.fsdp and part.config.pp > 1):
        yield
        return
    params = list(part.module.parameters())
    stash = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, old in zip(params, stash):
            if old is not None:
                p.grad = old if p.grad is None else old + p.grad


def _forward_packed(part: StagePart, batch: Mapping[str, torch.Tensor], output_fn: OutputFn | None, packing: Packing) -> torch.Tensor:
    """``forward`` over the packs without pipelining: each pack as wide as its own tokens, its
    output [1, tokens, …] padded back to the common width for the concatenation."""
    fn = output_fn or (lambda out, _mb: out)
    outs = []
    for m, w in enumerate(packing.lengths):
        mb = {**{k: v[m : m + 1, :w] for k, v in batch.items()}, **packing.model_inputs(m)}
        out = fn(part.module(mb["input_ids"], **_model_kwargs(mb)), mb)
        outs.append(F.pad(out, (0, 0) * (out.dim() - 2) + (0, packing.width - w)))
    reshard(part)
    return torch.cat(outs)


class _EvalStage(nn.Module):
    """A stage for forward-only pipelining: model kwargs to the Decoder, ``output_fn`` on the
    last stage's output with the whole micro-batch (every batch tensor arrives as a kwarg)."""

    def __init__(self, inner: nn.Module, output_fn: OutputFn | None) -> None:
        super().__init__()
        self.inner, self.output_fn = inner, output_fn

    def forward(self, x: torch.Tensor, **mb: torch.Tensor) -> torch.Tensor:
        out = self.inner(x, **_model_kwargs(mb))
        return out if self.output_fn is None else self.output_fn(out, mb)


@torch.no_grad()
def forward(
    part: StagePart,
    batch: Mapping[str, torch.Tensor],
    *,
    n_microbatches: int = 1,
    output_fn: OutputFn | None = None,
    packing: Packing | None = None,
) -> torch.Tensor:
    """Inference: the model's output (logits [B, T, V] or values [B, T]), or
    ``output_fn(output_m, batch_m)`` per micro-batch (e.g. the log-probs of the taken tokens,
    so that only [b, T] per micro-batch is kept, concatenated and broadcast, not [B, T, V]
    logits), concatenated along dim 0, on every rank of the replica (broadcast from the last
    PP stage).

    With ``packing`` the micro-batches are its packs and ``batch`` holds pack-major tensors
    [packs, width, …] (whatever ``output_fn`` reads besides the model's inputs);
    ``output_fn`` gives per-position values [1, tokens] of each pack and the result is
    [packs, width], for ``Packing.unpack`` to map back to rows."""
    if packing is not None and part.config.pp == 1:
        return _forward_packed(part, batch, output_fn, packing)
    if packing is not None:
        batch, n_microbatches = {**batch, **packing.model_inputs()}, len(packing.packs)
    _check_batch(batch, n_microbatches, part.config.pp)
    fn = output_fn or (lambda out, _mb: out)
    if part.config.pp == 1:
        outs = [fn(part.module(mb["input_ids"], **_model_kwargs(mb)), mb) for mb in split_batch(batch, n_microbatches)]
        reshard(part)
        return torch.cat(outs)
    wrapper = _EvalStage(part.module, fn if part.is_last else None)
    stage = PipelineStage(wrapper, part.stage, part.config.pp, part.device, group=part.groups.pp)
    # scale_grads=False: torch 2.13's eval() still divides any existing .grad by n (a pending
    # training step's gradients would silently shrink).
    schedule = ScheduleGPipe(stage, n_microbatches, scale_grads=False)
    args = (batch["input_ids"],) if part.is_first else ()
    with _keep_fsdp_grads(part):
        out = schedule.eval(*args, **batch)
    reshard(part)
    return _broadcast_from_last(part, out if part.is_last else None)
