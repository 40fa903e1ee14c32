"""A Llama/Qwen2-family decoder in plain PyTorch, with HuggingFace parameter names.

No parallelism lives here: TP (DTensor plans keyed by module name), PP (dropping layers and
the embedding/head) and FSDP/DDP are applied from outside. Build order, as in torchtitan:
``build_model(args)`` on ``meta`` -> parallelize -> ``to_empty(device=...)`` -> each rank's boxes
initialised (``parallelize.init_stage``: ``init_tensor``'s values) or loaded; a whole model on one
device: ``init_weights``.

Maths, per block (x: [B, T, h], d = head_dim, H query heads, K kv heads, r = H / K):

    a = x + o_proj(attn(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))
    y = a + down_proj(silu(gate_proj(n2(a))) * up_proj(n2(a)))

- RMSNorm n(x) = w * x / sqrt(mean(x^2) + eps), computed in float32 and cast back (as HF).
- RoPE in HF's ``rotate_half`` convention: dimension i is paired with i + d/2 (not with its
  neighbour), rotated by angle ``pos * theta^(-2i/d)``; positions count real tokens only, so
  a left-padded row starts at position 0 at its first real token. Llama 3.1's frequency
  scaling (``Llama3RopeScaling``) when the config has it.
- GQA: query head j reads kv head ``j // r`` (HF's ``repeat_kv``; here SDPA's ``enable_gqa``,
  which reads the shared heads without copying them).
- Attention is causal, scale 1/sqrt(d), through ``scaled_dot_product_attention``. Padded keys
  are masked; every query may always see its own slot, so a pad query's row is never empty
  (no NaN that a later layer could multiply by a zero weight).

Precision: parameters are stored in ``spec.dtype`` and the forward computes in
``ModelArgs.compute`` (``compute_dtype``, default the same). A training stage of a bf16 job
stores float32 master weights and computes in bf16: the embedding looks up in the compute
dtype, and every linear layer, norm and the tied output projection casts its weight to its
input's dtype on use (a no-op when they agree). The cast is differentiable, so the
bf16 gradient of each use lands in the float32 ``.grad`` — FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` contract, under every layout
(under FSDP2 with that policy the weights arrive in bf16 already and the casts do nothing).

Packed rows (``trainer/parallel/packing.py``): ``document_ids`` mark which row each position of a
packed sequence belongs to; attention is causal within a row only (``document_attention``:
one SDPA call per row of the pack, no mask) and positions restart at each row, so a row's
outputs are those of its padded forward.

Activation checkpointing: the layers named in ``Decoder.recompute`` (``set_recompute``) run
under ``torch.utils.checkpoint`` when gradients are recorded; backward recomputes them from
their input. The same kernels run on the same inputs, so gradients are bit for bit those of
a stored forward.

Head counts inside attention are read from the projections' output sizes (``view(B, T, -1, d)``),
so a TP plan that shards q/k/v by column runs the same code on local heads.

Pipeline stages: set ``model.embed_tokens``/``model.norm``/``lm_head``/``score`` to None and
delete entries of ``model.layers`` (keys "0".."N-1" stay stable). A forward given floating
point input treats it as hidden states [B, T, h] and skips the embedding; a stage whose
``model.norm`` is None returns hidden states. With tied embeddings the output projection is
``model.embed_tokens.weight`` (the last stage keeps a copy of it, as ``reshard.derive`` lays out).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nereus.reshard.derive import DecoderSpec
from nereus.reshard.layout import DTYPES

from ..seeds import param_seed


@dataclass(frozen=True, kw_only=True, slots=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (HF ``rope_type: llama3``). With the original
    context L, wavelength λ_i = 2π / f_i of frequency f_i: f_i stays when λ_i < L / high,
    becomes f_i / factor when λ_i > L / low, and in between is blended with
    s = (L / λ_i − low) / (high − low): (1 − s) · f_i / factor + s · f_i."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        context = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        low = torch.where(wavelen > context / self.low_freq_factor, inv_freq / self.factor, inv_freq)
        s = (context / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        medium = (wavelen >= context / self.high_freq_factor) & (wavelen <= context / self.low_freq_factor)
        return torch.where(medium, (1 - s) * low / self.factor + s * low, low)

    @classmethod
    def from_hf(cls, rope: Mapping) -> Llama3RopeScaling:
        try:
            return cls(
                factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ValueError(f"llama3 rope scaling {dict(rope)!r} lacks {e.args[0]!r}") from None

    def to_hf(self) -> dict:
        return {"rope_type": "llama3", "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelArgs:
    """A decoder: the shapes (``spec``, the same object reshard derives layouts from) plus
    what only the forward needs. ``model_type`` ("llama" | "qwen2") only names the HF family."""

    spec: DecoderSpec
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_seq_len: int = 2048
    model_type: str = "llama"
    rope_scaling: Llama3RopeScaling | None = None
    compute_dtype: str | None = None
    """Dtype of the forward's activations and matmuls (None: ``spec.dtype``, the storage)."""

    @property
    def compute(self) -> str:
        return self.compute_dtype or self.spec.dtype

    def __post_init__(self) -> None:
        if self.model_type not in ("llama", "qwen2"):
            raise ValueError(f"model_type must be 'llama' or 'qwen2', got {self.model_type!r}")
        if self.model_type == "qwen2" and not self.spec.qkv_bias:
            raise ValueError("a qwen2 model always has q/k/v biases: set spec.qkv_bias=True")
        if self.spec.dim_head % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.spec.dim_head}")
        if self.compute_dtype is not None and self.compute_dtype not in DTYPES:
            raise ValueError(f"compute_dtype must be one of {sorted(DTYPES)}, got {self.compute_dtype!r}")

    @classmethod
    def from_hf_config(cls, config: Mapping, *, dtype: str | None = None) -> ModelArgs:
        """Read a HuggingFace ``config.json`` dict (Llama or Qwen2 family).

        The head is "value" for ``*ForTokenClassification``/``*ForSequenceClassification``
        with one label, else "lm". ``dtype`` overrides the config's ``torch_dtype``.
        Features this model does not implement (rope scaling, sliding window, MLP bias,
        activations other than SiLU) are rejected, naming the key.
        """
        model_type = config.get("model_type")
        if model_type not in ("llama", "qwen2"):
            raise ValueError(f"config model_type={model_type!r}: only 'llama' and 'qwen2' are supported")
        rope = config.get("rope_parameters") or {}  # transformers >= 5 nests rope_theta here
        scaling = None
        for key in ("rope_scaling", "rope_parameters"):
            r = config.get(key) or {}
            kind = r.get("rope_type", r.get("type", "default"))
            if kind == "llama3":
                scaling = Llama3RopeScaling.from_hf(r)
            elif kind != "default":
                raise ValueError(f"config key {key!r}={r!r}: RoPE scaling {kind!r} is not supported (default and llama3 are)")
        unsupported = {
            "hidden_act": config.get("hidden_act", "silu") != "silu",
            "use_sliding_window": bool(config.get("use_sliding_window", False)),
            "mlp_bias": bool(config.get("mlp_bias", False)),
        }
        for key, bad in unsupported.items():
            if bad:
                raise ValueError(f"config key {key!r}={config[key]!r} is not supported by this model")
        spec = DecoderSpec.from_hf_config(config, dtype=dtype)
        if spec.head == "value" and len(config.get("id2label", {"0": ""})) != 1:
            raise ValueError(f"{config['architectures'][0]} with {len(config['id2label'])} labels: a value head has one")
        return cls(
            spec=spec,
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            model_type=model_type,
            rope_scaling=scaling,
        )

    def to_hf_config(self) -> dict:
        """The HuggingFace ``config.json`` dict; ``from_hf_config`` of it gives back ``self``
        (with ``model_type="qwen2"`` when q/k/v have biases: the family HF has for them)."""
        config = self.spec.to_hf_config(self.model_type)
        config.update(hidden_act="silu", max_position_embeddings=self.max_seq_len, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta)
        if self.rope_scaling is not None:
            config["rope_scaling"] = self.rope_scaling.to_hf()
        if config["model_type"] == "qwen2":
            config["use_sliding_window"] = False
        return config


class KVCache:
    """Keys and values of past tokens, per layer, preallocated to ``max_len`` slots.

    ``k[layer]``/``v[layer]``: [B, kv_heads, max_len, head_dim]; slots ``[0, length)`` are
    filled. ``key_mask`` [B, max_len] marks the slots holding real (not pad) tokens and
    ``seen`` [B] counts real tokens per row, which gives the next position id. A forward
    writes its T new tokens at slots ``[length, length + T)`` of every layer it holds, then
    advances ``length``: the modules keep no state. ``kv_heads`` is the number of heads
    this process computes (the local count under TP).
    """

    def __init__(
        self,
        *,
        batch_size: int,
        max_len: int,
        layers: Iterable[str],
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (batch_size, kv_heads, max_len, head_dim)
        self.batch_size, self.max_len, self.length = batch_size, max_len, 0
        self.k = {name: torch.zeros(shape, dtype=dtype, device=device) for name in layers}
        self.v = {name: torch.zeros(shape, dtype=dtype, device=device) for name in layers}
        self.key_mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.seen = torch.zeros(batch_size, dtype=torch.long, device=device)

    @classmethod
    def for_model(cls, model: Decoder, batch_size: int, max_len: int) -> KVCache:
        """A cache for the layers ``model`` holds, in its parameter dtype and device, with as
        many KV heads as this rank computes (all of them, or its TP share)."""
        p = next(model.parameters())
        spec = model.args.spec
        layers = list(model.model.layers.keys())
        kv_heads = spec.num_kv_heads
        if layers:  # TP-local heads: the rows of this rank's k_proj (a DTensor's local shard)
            weight = model.model.layers[layers[0]].self_attn.k_proj.weight
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            kv_heads = local.shape[0] // spec.dim_head
        return cls(
            batch_size=batch_size, max_len=max_len, layers=layers,
            kv_heads=kv_heads, head_dim=spec.dim_head, dtype=p.dtype, device=p.device,
        )

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [B'] of every tensor, in that order (rows may repeat): a cache
        prefilled once per distinct prompt becomes the cache of every sample of it."""
        self.k = {name: t.index_select(0, index) for name, t in self.k.items()}
        self.v = {name: t.index_select(0, index) for name, t in self.v.items()}
        self.key_mask, self.seen = self.key_mask.index_select(0, index), self.seen.index_select(0, index)
        self.batch_size = index.numel()

    def update(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v [B, kv_heads, T, d] of ``layer``; return all slots so far."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
    scaling: Llama3RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation of angle ``pos * theta^(-2i/d)``, i < d/2, as ``apply_rope`` takes it:
    cos and a signed sin, each [B, 1, T, d] (broadcast over heads). cos repeats the d/2
    angles for both halves (HF's layout); the signed sin is ``[-sin, sin]``, which folds
    ``rotate_half``'s negation into the table. Computed in float32 from integer positions
    (frequencies rescaled by ``scaling`` if given), then cast to ``dtype``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq)
    angles = position_ids.float()[:, None, :, None] * inv_freq
    sin = angles.sin()
    return torch.cat([angles, angles], dim=-1).cos().to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, d] by ``rope_cos_sin``'s tables: HF's
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) * sin = roll(x, d/2) * [-sin, sin]``
    (three kernels instead of seven; one decode step runs this 2 × layers times)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


@dataclass(frozen=True, slots=True)
class Documents:
    """Packed rows (``trainer/parallel/packing.py``) as attention sees them: per batch row, the
    boundaries ``0 = b_0 < b_1 < … < b_k = T`` of its documents (the padding at a pack's
    tail is one more). Attention runs causally within each document and never across."""

    bounds: tuple[tuple[int, ...], ...]

    @classmethod
    def from_ids(cls, document_ids: torch.Tensor) -> Documents:
        """From ``document_ids`` [B, T] (contiguous runs of one id; one host sync)."""
        t = document_ids.shape[1]
        change = (document_ids[:, 1:] != document_ids[:, :-1]).cpu()
        return cls(bounds=tuple((0, *(int(i) + 1 for i in row.nonzero().flatten()), t) for row in change))


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents) -> torch.Tensor:
    """Causal SDPA over q [B, H, T, d], k, v [B, K, T, d] within each document of ``docs``:
    the work and memory of the documents' own lengths (Σ L²), never of the pack (T²), and no
    mask (SDPA's causal kernels)."""
    gqa = q.shape[1] != k.shape[1]
    rows = []
    for i, bounds in enumerate(docs.bounds):
        parts = [F.scaled_dot_product_attention(q[i : i + 1, :, a:b], k[i : i + 1, :, a:b], v[i : i + 1, :, a:b], is_causal=True, enable_gqa=gqa)
                 for a, b in zip(bounds[:-1], bounds[1:])]
        rows.append(torch.cat(parts, 2) if len(parts) > 1 else parts[0])
    return torch.cat(rows, 0) if len(rows) > 1 else rows[0]


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions [B, T] that restart at 0 where each document of a packed row begins."""
    t = document_ids.shape[1]
    idx = torch.arange(t, device=document_ids.device).expand_as(document_ids)
    begins = torch.ones_like(document_ids, dtype=torch.bool)
    begins[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return idx - torch.where(begins, idx, 0).cummax(1).values


def attention_mask_4d(key_mask: torch.Tensor, start: int, num_queries: int) -> torch.Tensor:
    """Bool [B, 1, T, S]: query slot ``start + t`` sees key slot ``s`` iff ``s <= start + t`` and
    ``key_mask[b, s]`` (a real token), or ``s == start + t`` (its own slot, never an empty row)."""
    keys = torch.arange(key_mask.shape[1], device=key_mask.device)
    queries = start + torch.arange(num_queries, device=key_mask.device)[:, None]
    mask = (keys <= queries) & key_mask[:, None, :]
    return (mask | (keys == queries))[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # HF's order of operations; one call instead of four
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # normalised in float32, as HF
        return self.weight.to(x.dtype) * h.to(x.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` whose weight and bias are cast to the input's dtype on use (module
    docstring, "Precision"); TP styles apply to it as to any ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` that looks its rows up in the compute dtype: the table is cast
    first (a transient copy when the two differ), so that the gradient of a row is summed
    over its tokens in the compute dtype, then cast to the float32 master — what FSDP2's
    mixed precision does with its all-gathered bf16 table, so both layouts give the same
    update. Under TP ``parallel.parallelize.VocabParallelEmbedding`` replaces its forward (the same
    cast, on this rank's rows)."""

    def __init__(self, num: int, dim: int, *, dtype: torch.dtype, compute: torch.dtype) -> None:
        super().__init__(num, dim, dtype=dtype)
        self.compute = compute

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight.to(self.compute))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype) -> None:
        super().__init__()
        s = args.spec
        self.head_dim = s.dim_head
        q, kv = s.num_heads * self.head_dim, s.num_kv_heads * self.head_dim
        self.q_proj = Linear(s.hidden_size, q, bias=s.qkv_bias, dtype=dtype)
        self.k_proj = Linear(s.hidden_size, kv, bias=s.qkv_bias, dtype=dtype)
        self.v_proj = Linear(s.hidden_size, kv, bias=s.qkv_bias, dtype=dtype)
        self.o_proj = Linear(q, s.hidden_size, bias=False, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | Documents | None,
        kv_cache: KVCache | None,
        layer: str,
    ) -> torch.Tensor:
        """x [B, T, h]; mask bool [B, 1, T, S], an additive float mask [B, 1, 1, S] for one
        decode step, ``Documents`` for packed rows, or None for plain causal attention over x."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)
        if isinstance(mask, Documents):
            return self.o_proj(document_attention(q, k, v, mask).transpose(1, 2).reshape(b, t, -1))
        if t == 1 and mask is not None and mask.is_floating_point():
            return self.o_proj(_decode_attention(q, k, v, mask).view(b, 1, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """One query per row: q [B, H, 1, d] over k, v [B, K, S, d] with an additive mask
    ``bias`` [B, 1, 1, S]; returns [B, H, d] in head order. The r = H / K query heads of a
    kv head form the rows of one small matmul (GQA without copying k or v); for one query
    this is about twice as fast as SDPA's flash kernel on CPU."""
    b, h, _, d = q.shape
    grouped = q.view(b, k.shape[1], h // k.shape[1], d)  # head j -> kv head j // r
    scores = torch.matmul(grouped, k.transpose(-1, -2)).mul_(d**-0.5).add_(bias)
    return torch.matmul(scores.softmax(-1), v).view(b, h, d)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype) -> None:
        super().__init__()
        h, i = args.spec.hidden_size, args.spec.intermediate_size
        self.gate_proj = Linear(h, i, bias=False, dtype=dtype)
        self.up_proj = Linear(h, i, bias=False, dtype=dtype)
        self.down_proj = Linear(i, h, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = args.spec.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.self_attn = Attention(args, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.mlp = MLP(args, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | Documents | None,
        kv_cache: KVCache | None,
        layer: str,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, kv_cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """HF's ``model.``: embedding, layers keyed "0".."N-1", final norm (each may be absent)."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype) -> None:
        super().__init__()
        s = args.spec
        self.embed_tokens: nn.Embedding | None = Embedding(s.vocab_size, s.hidden_size, dtype=dtype, compute=DTYPES[args.compute])
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, dtype) for i in range(s.num_layers)})
        self.norm: RMSNorm | None = RMSNorm(s.hidden_size, args.rms_norm_eps, dtype)


class Decoder(nn.Module):
    """Causal LM (``lm_head``, or the tied embedding) or value model (``score``: one scalar
    per position). ``state_dict()`` names are HF's and equal ``plan_parameters(args.spec)``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        s, dtype = args.spec, DTYPES[args.spec.dtype]
        self.args = args
        self.model = DecoderStack(args, dtype)
        self.lm_head: nn.Linear | None = None
        self.score: nn.Linear | None = None
        self.recompute: frozenset[str] = frozenset()
        """Layers whose activations a training forward drops and backward recomputes
        (``set_recompute``)."""
        if s.head == "value":
            self.score = Linear(s.hidden_size, 1, bias=False, dtype=dtype)
        elif not s.tie_embeddings:
            self.lm_head = Linear(s.hidden_size, s.vocab_size, bias=False, dtype=dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V], values [B, T] (value head), or hidden states [B, T, h] (no final norm).

        ``input_ids``: token ids [B, T] (int), or hidden states [B, T, h] (float) from the
        previous pipeline stage. ``attention_mask``: bool [B, T], True for real tokens of
        this call (pad slots are never attended to; earlier slots' mask lives in the cache).
        ``position_ids`` default to the count of real tokens before each one (left padding
        gives 0 at a row's first real token). With ``kv_cache`` the T tokens follow the
        cached ones and the cache advances by T. ``document_ids`` [B, T]: packed rows
        (``document_attention``; positions default to ``document_positions``), instead of
        ``attention_mask``. Layers in ``self.recompute`` run under activation checkpointing
        when gradients are recorded.
        """
        body = self.model
        if input_ids.is_floating_point():
            h = input_ids
        elif body.embed_tokens is None:
            raise ValueError("this stage has no embed_tokens: pass hidden states [B, T, h], not token ids")
        else:
            h = body.embed_tokens(input_ids)
        if document_ids is not None:
            if attention_mask is not None or kv_cache is not None:
                raise ValueError("document_ids (packed rows) take neither an attention_mask nor a KV cache")
            mask = Documents.from_ids(document_ids)
            position_ids = document_positions(document_ids) if position_ids is None else position_ids
        else:
            position_ids, mask = self._positions_and_mask(h, position_ids, attention_mask, kv_cache)
        rope = rope_cos_sin(position_ids, self.args.spec.dim_head, self.args.rope_theta, h.dtype, self.args.rope_scaling)
        recompute = self.recompute if torch.is_grad_enabled() and kv_cache is None else ()
        for name, layer in body.layers.items():
            if name in recompute:
                # FSDP2 skips its forward hooks while recomputing in backward (the
                # pre-backward hook has gathered the weights); no dropout, no RNG to replay.
                h = checkpoint(layer, h, rope, mask, None, name, use_reentrant=False, preserve_rng_state=False)
            else:
                h = layer(h, rope, mask, kv_cache, name)
        if kv_cache is not None:
            t = h.shape[1]
            kv_cache.seen += kv_cache.key_mask[:, kv_cache.length : kv_cache.length + t].sum(1)
            kv_cache.length += t
        if body.norm is None:
            return h
        h = body.norm(h)
        if self.score is not None:
            return self.score(h)[..., 0].clone()  # a fresh tensor: FSDP2 hooks must not see a view
        if self.lm_head is not None:
            return self.lm_head(h)
        if self.args.spec.tie_embeddings and self.args.spec.head == "lm":
            if body.embed_tokens is None:
                raise ValueError("tied embeddings: the last stage needs model.embed_tokens for the output projection")
            return F.linear(h, body.embed_tokens.weight.to(h.dtype))
        return h

    @staticmethod
    def _positions_and_mask(h, position_ids, attention_mask, kv_cache):
        """Position ids [B, T] and the bool mask [B, 1, T, S] (None: plain causal over T)."""
        b, t = h.shape[:2]
        if kv_cache is None and attention_mask is None:
            if position_ids is None:
                position_ids = torch.arange(t, device=h.device).expand(b, t)
            return position_ids, None
        real = torch.ones(b, t, dtype=torch.bool, device=h.device) if attention_mask is None else attention_mask.bool()
        start, seen, keys = 0, 0, real
        if kv_cache is not None:
            start, seen = kv_cache.length, kv_cache.seen[:, None]
            if start + t > kv_cache.max_len:
                raise ValueError(f"KV cache holds {kv_cache.max_len} slots; {start} used, {t} more asked")
            kv_cache.key_mask[:, start : start + t] = real
            keys = kv_cache.key_mask[:, : start + t]
        if position_ids is None:
            position_ids = (seen + real.long().cumsum(1) - 1).clamp(min=0)
        mask = attention_mask_4d(keys, start, t)
        if kv_cache is not None and t == 1:  # a decode step: the additive form, built once for every layer
            mask = torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(~mask, float("-inf"))
        return position_ids, mask


def recompute_layers(mode: str, layers: Iterable[str]) -> frozenset[str]:
    """The layers activation checkpointing covers: ``full`` every transformer block,
    ``selective`` every other one (even indices: half the saving for half the recompute,
    torchtitan's layer-level selective mode), ``none`` none."""
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"recompute={mode!r} is not one of none, full, selective")
    return frozenset(n for n in layers if mode == "full" or (mode == "selective" and int(n) % 2 == 0))


def set_recompute(model: Decoder, mode: str) -> None:
    """Checkpoint ``model``'s layers per ``mode`` (``recompute_layers``) from the next forward."""
    model.recompute = recompute_layers(mode, model.model.layers.keys())


def build_model(args: ModelArgs, device: torch.device | str = "meta") -> Decoder:
    """The model with uninitialised parameters on ``device`` (``meta`` by default: no memory)."""
    with torch.device(device):
        return Decoder(args)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic init after ``to_empty`` (``init_tensor`` per parameter). Plain (not yet
    distributed) tensors only; a parallelized stage's boxes: ``parallelize.init_stage``."""
    for name, p in model.named_parameters():
        p.copy_(init_tensor(name, p.shape, seed, std))


def init_tensor(name: str, shape: Sequence[int], seed: int, std: float) -> torch.Tensor:
    """The full initial value of parameter ``name``, in float32: norms 1, biases 0, matrices
    N(0, std) from a CPU generator of its own seeded by (seed, name) — so a pipeline stage, a
    stage's copy of a tied embedding or a rank's box gets the full model's values, on any device."""
    if name.endswith("norm.weight"):
        return torch.ones(tuple(shape), dtype=torch.float32)
    if name.endswith(".bias"):
        return torch.zeros(tuple(shape), dtype=torch.float32)
    g = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(tuple(shape), dtype=torch.float32).normal_(0.0, std, generator=g)
