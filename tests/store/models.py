"""Tiny HF-format models written by the tests themselves (random tensors, HF names, no hub)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from nereus.reshard.derive import plan_parameters
from nereus.reshard.layout import DTYPES
from nereus.store.hf import spec_from_hf_config


def llama_config(dtype: str = "float32", **overrides) -> dict:
    """A Llama-family config: GQA (4 heads, 2 KV heads), untied embeddings."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    config.update(overrides)
    return config


def qwen2_config(dtype: str = "float32", **overrides) -> dict:
    """A Qwen2-style config: q/k/v biases, tied embeddings."""
    return llama_config(dtype, architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True, **overrides)


def odd_vocabulary_llama(path, *, vocab_size: int = 21, seed: int = 0) -> None:
    """A Llama saved by transformers itself (``save_pretrained``), with a vocabulary few TP
    degrees divide: 21 tokens, 6 heads over one KV head (GQA: tp = 2, 3 and 6 fit), hidden 48,
    2 layers, untied, float32, every weight random (norm weights 1 + N(0, 0.3²), matrices
    N(0, 1/fan_in)). tp=2 cuts its vocabulary 11 + 10, tp=6 4, 4, 4, 4, 4, 1."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5) + (p.dim() == 1))
    model.save_pretrained(str(path), safe_serialization=True)


def random_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    spec = spec_from_hf_config(config)
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[spec.dtype]
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape, _, _ in plan_parameters(spec)}


def write_hf_model(path, config: dict, *, shards: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write config.json and the weights (``shards`` files + index when > 1); returns the weights."""
    os.makedirs(path, exist_ok=True)
    weights = random_weights(config, seed)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if shards == 1:
        save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return weights
    names = list(weights)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[k::shards]}
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return weights


def bits(t: torch.Tensor) -> torch.Tensor:
    """A bitwise view for exact comparison (NaN payloads, signed zeros)."""
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.dim() else t
