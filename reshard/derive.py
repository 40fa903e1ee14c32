"""Derivation of EMUs from a decoder description and a parallel config (pure).

Sharding rules, per HuggingFace parameter of a Llama/Qwen2-family decoder, for TP degree t:

- ``embed_tokens``, ``lm_head``: vocab-parallel, dim 0 in ``torch.chunk`` pieces of
  ``c = ceil(V / t)`` rows (DTensor's ``Shard(0)``): TP rank r holds token ids
  ``[min(r·c, V), min((r+1)·c, V))`` (``vocab_range``), the last shards shorter and (only
  when ``V ≤ (t − 1)²``) possibly empty: no shard, the rank holds none of the tensor. No
  padding: every layout holds exactly the real V rows, so EMUs, checkpoints and HF exports are the
  same whatever the TP degree (``docs/vocab.md``). t > V is refused;
- ``q_proj``, ``gate_proj``, ``up_proj`` (and q/k/v biases): column-parallel, dim 0 split;
- ``k_proj``, ``v_proj``: split by KV head when t divides the KV heads; when there are
  fewer KV heads than TP ranks (GQA), each head is replicated on t / kv consecutive
  ranks, as vLLM does, so rank r holds head ``r // (t / kv)``;
- ``o_proj``, ``down_proj``: row-parallel, dim 1 split;
- norms, the value head: replicated.

PP splits layers into contiguous ranges (the first ``layers % pp`` stages take one more);
the first stage holds the embedding, the last the final norm and lm_head/score. With tied
embeddings and pp > 1 the last stage also holds a copy of ``embed_tokens`` (Megatron's
embedding group). With ``dp_shard`` each TP shard is further split along dim 0 over the dp
ranks in ``torch.chunk`` pieces (FSDP2's Shard(0) over the local tensor); 0-d tensors stay
replicated. Optimizer state (AdamW) is named ``optim/exp_avg/<param>``,
``optim/exp_avg_sq/<param>`` (same layout and dtype as the parameter) and
``optim/step/<param>`` (0-d float32 on every rank that holds the parameter).

``fused`` gives the vLLM rollout layout: per TP rank, ``qkv_proj`` = [q_r; k_r; v_r] and
``gate_up_proj`` = [gate_r; up_r] are single buffers whose pieces are the logical q/k/v and
gate/up shards; the logical names stay HF's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import LayoutError
from .layout import EMU, Dims, ParallelConfig, Shard, TensorLayout, dtype_name, itemsize

OPTIM_STATES = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, kw_only=True, slots=True)
class DecoderSpec:
    """Shapes of a Llama/Qwen2-family decoder; HF names. ``head`` is "lm" or "value"."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    qkv_bias: bool = False
    tie_embeddings: bool = False
    head: str = "lm"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        dtype_name(self.dtype)
        if self.head not in ("lm", "value"):
            raise LayoutError(f"decoder head must be 'lm' or 'value', got {self.head!r}")
        if self.num_heads % self.num_kv_heads:
            raise LayoutError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise LayoutError(f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}")

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @classmethod
    def from_hf_config(cls, config, *, dtype: str | None = None) -> DecoderSpec:
        """The shapes of a Llama/Qwen2-family HuggingFace ``config.json`` dict (pure).

        Only shapes are read; the head is "value" for ``*ForTokenClassification`` and
        ``*ForSequenceClassification``, else "lm"; ``dtype`` overrides ``torch_dtype``.
        Raises ValueError naming the model type or the missing key. The store's converter
        and the trainer's model both read configs through this.
        """
        model_type = config.get("model_type", "llama")
        if model_type not in ("llama", "qwen2"):
            raise ValueError(f"config.json model_type={model_type!r}: only 'llama' and 'qwen2' are supported")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in config:
                raise ValueError(f"config.json lacks {key!r}")
        if model_type == "llama" and config.get("attention_bias"):
            # HF's (and vLLM's) Llama puts this bias on q, k, v AND o_proj; this decoder has
            # no o_proj bias (q/k/v biases alone are the qwen2 family)
            raise ValueError(f"config.json attention_bias={config['attention_bias']!r}: a Llama o_proj bias is not supported")
        architecture = (config.get("architectures") or ["ForCausalLM"])[0]
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim"),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            head="value" if architecture.endswith(("ForTokenClassification", "ForSequenceClassification")) else "lm",
            dtype=dtype_name(dtype or config.get("torch_dtype") or config.get("dtype") or "float32"),
        )

    def to_hf_config(self, model_type: str = "llama") -> dict:
        """The shape keys of a ``config.json`` (``from_hf_config`` of it gives back ``self``);
        the trainer's ``ModelArgs.to_hf_config`` adds what only the forward needs. q/k/v biases
        are written as the qwen2 family whatever ``model_type`` says: HF's Llama has no
        q/k/v-only bias (its ``attention_bias`` adds one to o_proj too)."""
        if self.qkv_bias:
            model_type = "qwen2"
        family = {"llama": "Llama", "qwen2": "Qwen2"}[model_type]
        config = {
            "architectures": [family + ("ForTokenClassification" if self.head == "value" else "ForCausalLM")],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "tie_word_embeddings": self.tie_embeddings,
            "torch_dtype": self.dtype,
        }
        if self.head_dim is not None:
            config["head_dim"] = self.head_dim
        if model_type == "llama":  # no biases (Qwen2 always has q/k/v biases)
            config["attention_bias"] = False
        if self.head == "value":  # one label; HF's token-classification score has a bias unless told
            config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
            config["token_classification_bias"] = False
        return config


# A parameter: (HF name, global shape, sharding kind, layer index or -1, place)
# place: "first" (embedding), "last" (final norm, heads), "layer".
ParamDesc = tuple[str, Dims, str, int]


def plan_parameters(spec: DecoderSpec) -> list[ParamDesc]:
    """Every parameter as (name, shape, kind, layer); layer -1 = embedding, -2 = final."""
    h, i, v, hd = spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.dim_head
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    params: list[ParamDesc] = [("model.embed_tokens.weight", (v, h), "vocab", -1)]
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        params += [
            (p + "input_layernorm.weight", (h,), "rep", layer),
            (p + "self_attn.q_proj.weight", (q, h), "col", layer),
            (p + "self_attn.k_proj.weight", (kv, h), "kv", layer),
            (p + "self_attn.v_proj.weight", (kv, h), "kv", layer),
        ]
        if spec.qkv_bias:
            params += [
                (p + "self_attn.q_proj.bias", (q,), "col", layer),
                (p + "self_attn.k_proj.bias", (kv,), "kv", layer),
                (p + "self_attn.v_proj.bias", (kv,), "kv", layer),
            ]
        params += [
            (p + "self_attn.o_proj.weight", (h, q), "row", layer),
            (p + "post_attention_layernorm.weight", (h,), "rep", layer),
            (p + "mlp.gate_proj.weight", (i, h), "col", layer),
            (p + "mlp.up_proj.weight", (i, h), "col", layer),
            (p + "mlp.down_proj.weight", (h, i), "row", layer),
        ]
    params.append(("model.norm.weight", (h,), "rep", -2))
    if spec.head == "value":
        params.append(("score.weight", (1, h), "rep", -2))
    elif not spec.tie_embeddings:
        params.append(("lm_head.weight", (v, h), "vocab", -2))
    return params


def plan_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges per pipeline stage; the first ``num_layers % pp`` get one more."""
    if pp > num_layers:
        raise LayoutError(f"pp={pp} is larger than the number of layers ({num_layers})")
    base, extra = divmod(num_layers, pp)
    ranges, start = [], 0
    for stage in range(pp):
        n = base + (stage < extra)
        ranges.append(range(start, start + n))
        start += n
    return ranges


def vocab_shard_rows(vocab_size, tp):
    """Rows of the largest vocabulary shard under TP degree ``tp``: ``ceil(V / tp)`` (TP rank
    0's; elementwise over numpy arrays of ``tp``). What a layout's memory and time are priced by."""
    return -(-vocab_size // tp)


def vocab_range(vocab_size: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """Token ids ``[start, stop)`` TP rank ``tp_rank`` of ``tp`` holds of a vocab-parallel
    tensor: ``torch.chunk``/DTensor ``Shard(0)`` of V rows, ``start == stop`` when the rank's
    shard is empty (the module docstring)."""
    rows = vocab_shard_rows(vocab_size, tp)
    return min(tp_rank * rows, vocab_size), min((tp_rank + 1) * rows, vocab_size)


def check_tp(spec: DecoderSpec, tp: int) -> None:
    """Raise unless ``tp`` fits what TP splits: it divides the heads and the intermediate size,
    the KV heads divide it or it them, and it is at most the vocabulary (which need not
    divide: the vocab shards are ``vocab_range``'s, the last shorter)."""
    kv = spec.num_kv_heads
    if spec.num_heads % tp:
        raise LayoutError(f"tp={tp} does not divide num_heads={spec.num_heads}")
    if kv % tp and tp % kv:
        raise LayoutError(f"tp={tp} and num_kv_heads={kv}: one must divide the other")
    if tp > spec.vocab_size:
        raise LayoutError(f"tp={tp} is larger than vocab_size={spec.vocab_size}: more TP ranks than vocabulary rows")
    if spec.intermediate_size % tp:
        raise LayoutError(f"tp={tp} does not divide intermediate_size={spec.intermediate_size}")


def _tp_box(spec: DecoderSpec, shape: Dims, kind: str, tp: int, t: int) -> tuple[Dims, Dims]:
    """The (offsets, lengths) TP rank ``t`` holds of a parameter of this kind."""
    if kind == "rep" or tp == 1:
        return (0,) * len(shape), shape
    if kind == "row":
        n = shape[1] // tp
        return (0, t * n), (shape[0], n)
    if kind == "vocab":
        start, stop = vocab_range(shape[0], tp, t)
        return (start, 0), (stop - start, shape[1])
    if kind == "kv" and spec.num_kv_heads < tp:
        hd = spec.dim_head
        head = t // (tp // spec.num_kv_heads)
        return (head * hd,) + (0,) * (len(shape) - 1), (hd,) + shape[1:]
    n = shape[0] // tp
    return (t * n,) + (0,) * (len(shape) - 1), (n,) + shape[1:]


def _chunks(offset: int, length: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk`` of a dim-0 extent into ``parts`` (start, length); empty ones dropped."""
    size = -(-length // parts) if length else 0
    out = []
    for d in range(parts):
        lo, hi = min(d * size, length), min((d + 1) * size, length)
        out.append((offset + lo, hi - lo))
    return out


_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _fused_piece(spec: DecoderSpec, name: str, tp: int) -> tuple[str, int] | None:
    """(buffer, row) for a parameter that vLLM fuses, else None; rows of the TP-local piece."""
    prefix, _, rest = name.partition(".layers.")
    layer, _, leaf = rest.partition(".")
    module, _, kind = leaf.rpartition(".")
    if module not in _FUSED:
        return None
    fused, position = _FUSED[module]
    hd = spec.dim_head
    q_rows = spec.num_heads * hd // tp
    kv_rows = max(spec.num_kv_heads // tp, 1) * hd
    if fused.endswith("qkv_proj"):
        row = (0, q_rows, q_rows + kv_rows)[position]
    else:
        row = position * spec.intermediate_size // tp
    return f"{prefix}.layers.{layer}.{fused}.{kind}", row


def derive_emus(
    spec: DecoderSpec,
    config: ParallelConfig,
    *,
    model: str,
    stage: str,
    optimizer: bool = False,
    dp_shard: bool = False,
    fused: bool = False,
    version: int = 0,
) -> list[EMU]:
    """The EMUs of one model-stage: one per dp replica, or one over all ranks with ``dp_shard``."""
    check_tp(spec, config.tp)
    if fused and dp_shard:
        raise LayoutError("a fused (vLLM rollout) layout cannot also shard state over dp")
    ranges = plan_layer_ranges(spec.num_layers, config.pp)
    stage_of_layer = {layer: p for p, r in enumerate(ranges) for layer in r}
    params = plan_parameters(spec)

    def stages_of(name: str, layer: int) -> list[int]:
        if layer >= 0:
            return [stage_of_layer[layer]]
        if layer == -2:
            return [config.pp - 1]
        tied_copy = spec.tie_embeddings and spec.head == "lm" and config.pp > 1
        return [0, config.pp - 1] if tied_copy else [0]

    replicas = [None] if dp_shard else list(range(config.dp))
    emus = []
    for replica in replicas:
        dps = range(config.dp) if replica is None else [replica]
        tensors: list[TensorLayout] = []
        interned: dict[tuple, tuple[Shard, ...]] = {}  # one tuple per distinct placement
        for name, shape, kind, layer in params:
            piece = _fused_piece(spec, name, config.tp) if fused else None
            stages = stages_of(name, layer)
            key = (tuple(stages), shape, kind, piece)
            if key in interned:
                tensors.append(TensorLayout.trusted(name=name, shape=shape, dtype=spec.dtype, shards=interned[key]))
                continue
            shards = []
            for p in stages:
                for t in range(config.tp):
                    offsets, lengths = _tp_box(spec, shape, kind, config.tp, t)
                    if lengths[0] == 0:
                        continue  # an empty vocabulary shard: this TP rank holds none of the tensor
                    buffer, row = piece or ("", 0)
                    for d in dps:
                        rank = config.rank(dp=d, pp=p, tp=t)
                        if replica is None and config.dp > 1:
                            part = _chunks(offsets[0], lengths[0], config.dp)[d]
                            if part[1] == 0:
                                continue
                            shards.append(Shard(rank=rank, offsets=(part[0], *offsets[1:]), lengths=(part[1], *lengths[1:])))
                        else:
                            shards.append(Shard(rank=rank, offsets=offsets, lengths=lengths, buffer=buffer, row=row))
            interned[key] = tuple(shards)
            tensors.append(TensorLayout.trusted(name=name, shape=shape, dtype=spec.dtype, shards=interned[key]))
        if optimizer:
            tensors += _optimizer_layouts(tensors)
        ranks = config.ranks if replica is None else config.replica_ranks(replica)
        emus.append(
            EMU.trusted(
                model=model, stage=stage, replica=replica or 0, config=config, ranks=ranks, version=version, tensors=tuple(tensors)
            )
        )
    return emus


def _optimizer_layouts(params: list[TensorLayout]) -> list[TensorLayout]:
    """AdamW state beside each parameter: moments laid out like it, a 0-d step per holder."""
    out = []
    unfused: dict[int, tuple[Shard, ...]] = {}  # by id of the (interned) parameter shards
    for p in params:
        if id(p.shards) not in unfused:
            unfused[id(p.shards)] = tuple(s if not s.buffer else Shard(rank=s.rank, offsets=s.offsets, lengths=s.lengths) for s in p.shards)
    plain = {p.name: unfused[id(p.shards)] for p in params}
    for state in OPTIM_STATES:
        for p in params:
            out.append(TensorLayout.trusted(name=f"optim/{state}/{p.name}", shape=p.shape, dtype=p.dtype, shards=plain[p.name]))
    steps: dict[tuple[int, ...], tuple[Shard, ...]] = {}
    for p in params:
        holders = tuple(sorted({s.rank for s in p.shards}))
        if holders not in steps:
            steps[holders] = tuple(Shard(rank=r, offsets=(), lengths=()) for r in holders)
        out.append(TensorLayout.trusted(name=f"optim/step/{p.name}", shape=(), dtype="float32", shards=steps[holders]))
    return out


def state_nbytes(emus: list[EMU]) -> int:
    """Bytes of all shards of these EMUs, replicas included (what the ranks hold together)."""
    return sum(
        math.prod(s.lengths) * itemsize(t.dtype)
        for e in emus
        for t in e.tensors
        for s in t.shards
    )
