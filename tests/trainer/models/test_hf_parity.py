"""HuggingFace parity: Nereus's decoder, loaded from a directory transformers saved, computes
what transformers computes.

Each variant is a tiny transformers model (float32, seeded), every weight randomised (norm
weights and biases too, which HF initialises to 1 and 0, so a wrong mapping cannot pass),
saved with ``save_pretrained(safe_serialization=True)``. Loading takes the route a job's
``model.path`` takes: one spawned 1-rank gloo process runs ``trainer.parallel.build_stage`` on
``ModelArgs.from_hf_config(config.json)`` and ``trainer.loop.load_hf`` (``HFCheckpoint.open``,
``check_against_spec``, ``check_forward_settings``, ``load_full`` of memory-mapped tensors into
derive's boxes) for every variant; it sends the loaded parameters back by name. The parent puts
them into ``build_model(args, "cpu")``, the module ``build_stage`` builds at dp = tp = pp = 1
(the stage's own args come from the checkpoint here, not from a job config).

Comparisons: float32 on both sides (transformers' default SDPA attention), ``|nereus - hf| <=
ATOL + RTOL * |hf|`` with both 1e-5 (logits are O(1-10); the worst case measured uses about half
of it); only real (not pad) positions. Transformers gets the attention mask AND position ids that
count real tokens (Nereus's default, ``Decoder._positions_and_mask``); its own default counts
slots, which differs on left-padded rows. Two conventions differ on purpose: Nereus pools a
sequence score at the last True of the attention mask, transformers at the rightmost token whose
id is not ``pad_token_id`` (so the tests never draw the pad id as a real token).

The last section goes the other way: what Nereus exports (``to_hf_config`` + ``HFWriter``) must
load into transformers with every tensor and give the same outputs.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import transformers  # the test extra pins >= 5.0 (rope_parameters): a missing or old one fails, never skips

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"the HF parity tests need transformers >= 5.0 (pip install -e '.[test]'), found {transformers.__version__}")

from nereus.reshard.derive import DecoderSpec, plan_parameters  # noqa: E402
from nereus.reshard.layout import ParallelConfig  # noqa: E402
from nereus.store.errors import ModelMismatchError  # noqa: E402
from nereus.store.hf import HFCheckpoint, HFWriter, check_against_spec  # noqa: E402
from nereus.trainer.rollout.generator import generate  # noqa: E402
from nereus.trainer.models.decoder import KVCache, Llama3RopeScaling, ModelArgs, build_model, init_weights  # noqa: E402
from nereus.trainer.runtime.stages import sequence_scores  # noqa: E402

ATOL = RTOL = 1e-5
VOCAB, PAD = 96, 0  # real tokens are drawn from 1..VOCAB-1: HF's pooling finds pads by id
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}  # a short original context: scaling changes every frequency
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_attention_heads=4, pad_token_id=PAD)

# name -> (transformers class, config kwargs); "-v4config": config.json as transformers 4 wrote it
VARIANTS = {
    "llama-gqa-llama3rope-untied": ("LlamaForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=2, rope_theta=5e5, rope_scaling=LLAMA31, rms_norm_eps=1e-5,
        tie_word_embeddings=False)),
    "llama-mha-headdim24-tied": ("LlamaForCausalLM", dict(
        num_hidden_layers=2, num_key_value_heads=4, head_dim=24, rope_theta=1234.5, rms_norm_eps=1e-4,
        tie_word_embeddings=True)),
    "qwen2-gqa-tied": ("Qwen2ForCausalLM", dict(
        num_hidden_layers=2, num_key_value_heads=2, rope_theta=2e4, rms_norm_eps=3e-6, tie_word_embeddings=True)),
    "qwen2-mha-untied-v4config": ("Qwen2ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, rope_theta=777.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama-value-gqa-llama3rope-v4config": ("LlamaForSequenceClassification", dict(
        num_hidden_layers=2, num_key_value_heads=2, rope_theta=5e5, rope_scaling=LLAMA31, rms_norm_eps=1e-5, num_labels=1)),
    "qwen2-value-mha-headdim24": ("Qwen2ForSequenceClassification", dict(
        num_hidden_layers=2, num_key_value_heads=4, head_dim=24, rope_theta=3e3, rms_norm_eps=1e-6, num_labels=1)),
}
LM = [n for n, (cls, _) in VARIANTS.items() if cls.endswith("CausalLM")]
VALUE = [n for n in VARIANTS if n not in LM]


def make_hf(cls_name: str, kwargs: dict, seed: int = 0):
    """The transformers model in eval mode with every parameter drawn at random: matrices
    N(0, 1/fan_in), embeddings N(0, 0.3^2), norm weights 1 + N(0, 0.3^2), biases N(0, 0.3^2)."""
    family = "Qwen2" if cls_name.startswith("Qwen2") else "Llama"
    config = getattr(transformers, family + "Config")(**BASE, **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * r)
            elif name.endswith(".bias") or name.endswith("embed_tokens.weight"):
                p.copy_(0.3 * r)
            else:
                p.copy_(r / p.shape[1] ** 0.5)
    return model


def as_transformers4_config(path: str) -> None:
    """Rewrite config.json as transformers 4 wrote it (most Hub checkpoints): ``rope_theta`` at
    the top, the scaling under ``rope_scaling``, ``torch_dtype``; transformers 5 reads either."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    config["torch_dtype"] = config.pop("dtype")
    with open(file, "w") as f:
        json.dump(config, f)


def _load_stages(rank: int, world_size: int, dirs: dict[str, str]) -> dict[str, dict]:
    """In the 1-rank gloo child: each directory through build_stage + load_hf, as numpy."""
    from nereus.trainer.config import StageConfig
    from nereus.trainer.runtime.checkpoint import load_hf
    from nereus.trainer.parallel.parallelize import build_stage
    from nereus.trainer.runtime.stages import ModelStage

    out = {}
    for name, path in dirs.items():
        with open(os.path.join(path, "config.json")) as f:
            args = ModelArgs.from_hf_config(json.load(f))
        config = ParallelConfig.on()
        stage = ModelStage(key="m.s", args=args, config=config, settings=StageConfig(), part=build_stage(args, config, rank))
        load_hf(stage, path)
        out[name] = {n: t.detach().numpy().copy() for n, t in stage.part.module.state_dict().items()}
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """name -> (transformers model, Nereus model loaded from its saved directory)."""
    from tests.distributed_harness import run_distributed

    hf, dirs = {}, {}
    for name, (cls_name, kwargs) in VARIANTS.items():
        hf[name] = make_hf(cls_name, kwargs)
        dirs[name] = str(tmp_path_factory.mktemp(name))
        hf[name].save_pretrained(dirs[name], safe_serialization=True)
        if name.endswith("-v4config"):
            as_transformers4_config(dirs[name])
            assert transformers.AutoConfig.from_pretrained(dirs[name]).rope_parameters == hf[name].config.rope_parameters
    loaded = run_distributed(_load_stages, 1, dirs, timeout=120.0)[0]
    out = {}
    for name, path in dirs.items():
        ours = build_model(ModelArgs.from_hf_config(HFCheckpoint.open(path).config), "cpu").eval()
        ours.load_state_dict({n: torch.from_numpy(a) for n, a in loaded[name].items()}, strict=True)
        out[name] = hf[name], ours
    return out


def ids_and_masks(b: int, t: int, lengths: list[int], *, left: bool, seed: int = 2):
    """Token ids [b, t] (pads = PAD), the real-token mask and position ids counting real tokens."""
    ids = torch.randint(1, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))
    slots = torch.arange(t)
    lens = torch.tensor(lengths)[:, None]
    mask = slots >= t - lens if left else slots < lens
    return ids.masked_fill(~mask, PAD), mask, (mask.long().cumsum(1) - 1).clamp(min=0)


def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------- names and values


@pytest.mark.parametrize("name", list(VARIANTS))
def test_loaded_parameters_are_transformers_parameters_bit_for_bit(models, name):
    hf, ours = models[name]
    theirs, mine = hf.state_dict(), ours.state_dict()
    tied_head = {"lm_head.weight"} if hf.config.tie_word_embeddings and "lm_head.weight" in theirs else set()
    assert set(mine) == set(theirs) - tied_head
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)


# ---------------------------------------------------------------- causal LM logits


@pytest.mark.parametrize("name", LM)
def test_logits_equal_transformers_on_an_unpadded_batch(models, name):
    hf, ours = models[name]
    ids, _, _ = ids_and_masks(4, 40, [40] * 4, left=True)
    with torch.no_grad():
        close(ours(ids), hf(ids).logits)


@pytest.mark.parametrize("name", LM)
def test_logits_equal_transformers_on_left_padded_rows_at_real_positions(models, name):
    hf, ours = models[name]
    ids, mask, pos = ids_and_masks(4, 24, [24, 17, 6, 1], left=True)
    with torch.no_grad():
        mine = ours(ids, attention_mask=mask)
        theirs = hf(ids, attention_mask=mask.long(), position_ids=pos).logits
    close(mine[mask], theirs[mask])


@pytest.mark.parametrize("name", LM)
def test_kv_cache_prefill_and_decode_logits_equal_transformers_full_forward(models, name):
    """Prefill of left-padded prompts, two one-token steps (row 1 stops after the first), then a
    chunk of three, each through ``KVCache``; transformers runs the whole sequence at once."""
    hf, ours = models[name]
    prompt, prompt_mask, _ = ids_and_masks(3, 12, [12, 7, 2], left=True)
    more = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(3))
    more_mask = torch.tensor([[True] * 5, [True, False, False, False, False], [True] * 5])
    ids, mask = torch.cat([prompt, more.masked_fill(~more_mask, PAD)], 1), torch.cat([prompt_mask, more_mask], 1)
    with torch.no_grad():
        cache = KVCache.for_model(ours, batch_size=3, max_len=ids.shape[1])
        parts = [ours(prompt, attention_mask=prompt_mask, kv_cache=cache)]
        for lo, hi in [(0, 1), (1, 2), (2, 5)]:
            parts.append(ours(ids[:, 12 + lo : 12 + hi], attention_mask=more_mask[:, lo:hi], kv_cache=cache))
        theirs = hf(ids, attention_mask=mask.long(), position_ids=(mask.long().cumsum(1) - 1).clamp(min=0)).logits
    close(torch.cat(parts, 1)[mask], theirs[mask])


@pytest.mark.parametrize("name", LM)
def test_generate_logprobs_equal_transformers_teacher_forced_logprobs(models, name):
    """``trainer.generate.generate`` (prefill, cached decode, stop tokens: a quarter of the
    vocabulary, so rows stop at different steps): each sampled token's log-prob equals
    transformers' log-softmax over the finished rollout."""
    hf, ours = models[name]
    prompts = [[5, 9, 3, 7, 1, 2, 11], [4, 4, 30, 2], [8]]
    with torch.no_grad():
        out = generate(ours, prompts, max_new_tokens=8, stop_tokens=range(1, 25), pad_id=PAD,
                       generator=torch.Generator().manual_seed(4))
        mask = out.attention_mask
        logits = hf(out.tokens, attention_mask=mask.long(), position_ids=(mask.long().cumsum(1) - 1).clamp(min=0)).logits
    p = out.prompt_width
    teacher = torch.log_softmax(logits[:, p - 1 : -1], -1).gather(-1, out.tokens[:, p:, None])[..., 0]
    real = out.response_mask[:, p:]
    assert real.sum() > 3 and not real.all()  # some rows stopped early
    close(out.logprobs[real], teacher[real])


def test_llama3_rope_scaling_changes_these_logits(models):
    """The scaled variant is sensitive to the scaling: without it Nereus would be far off."""
    hf, ours = models["llama-gqa-llama3rope-untied"]
    plain = build_model(dataclasses.replace(ours.args, rope_scaling=None), "cpu").eval()
    plain.load_state_dict(ours.state_dict())
    ids, _, _ = ids_and_masks(2, 32, [32, 32], left=True)
    with torch.no_grad():
        assert (plain(ids) - hf(ids).logits).abs().max() > 1e-2


# ---------------------------------------------------------------- value heads


def hf_values(hf, ids, mask, pos) -> torch.Tensor:
    """transformers' per-position score [B, T]: its decoder's hidden states through its ``score``."""
    return hf.score(hf.model(ids, attention_mask=mask.long(), position_ids=pos).last_hidden_state)[..., 0]


def stage_rows():
    """Rows as ``trainer.stages`` holds them: left-padded prompts (width 6), right-padded responses."""
    prompts, p_mask, _ = ids_and_masks(4, 6, [6, 3, 1, 4], left=True, seed=5)
    responses, r_mask, _ = ids_and_masks(4, 9, [9, 2, 5, 1], left=False, seed=6)
    mask = torch.cat([p_mask, r_mask], 1)
    return torch.cat([prompts, responses], 1), mask, (mask.long().cumsum(1) - 1).clamp(min=0)


@pytest.mark.parametrize("name", VALUE)
def test_values_per_position_equal_transformers_score_of_its_hidden_states(models, name):
    hf, ours = models[name]
    ids, mask, pos = ids_and_masks(3, 20, [20] * 3, left=True)
    with torch.no_grad():
        close(ours(ids), hf_values(hf, ids, mask, pos))
        ids, mask, pos = stage_rows()
        close(ours(ids, attention_mask=mask)[mask], hf_values(hf, ids, mask, pos)[mask])


@pytest.mark.parametrize("name", VALUE)
def test_sequence_scores_equal_transformers_pooled_logits(models, name):
    """Right-padded rows with transformers' default positions (slot = count of real tokens
    there), and the stages' left+right padded rows with explicit ones: HF pools at the
    rightmost non-pad id, Nereus at the last True of the attention mask."""
    hf, ours = models[name]
    with torch.no_grad():
        ids, mask, _ = ids_and_masks(4, 15, [15, 9, 4, 1], left=False)
        close(sequence_scores(ours(ids, attention_mask=mask), {"attention_mask": mask}),
              hf(ids, attention_mask=mask.long()).logits[:, 0])
        ids, mask, pos = stage_rows()
        close(sequence_scores(ours(ids, attention_mask=mask), {"attention_mask": mask}),
              hf(ids, attention_mask=mask.long(), position_ids=pos).logits[:, 0])


# ---------------------------------------------------------------- what Nereus refuses


def test_qwen2_sliding_window_is_refused_naming_the_key():
    config = make_hf("Qwen2ForCausalLM", dict(num_hidden_layers=1, num_key_value_heads=2, use_sliding_window=True,
                                             sliding_window=8, max_window_layers=0)).config.to_dict()
    with pytest.raises(ValueError, match="'use_sliding_window'=True"):
        ModelArgs.from_hf_config(config)


def test_llama_attention_bias_is_refused_naming_the_key():
    config = make_hf("LlamaForCausalLM", dict(num_hidden_layers=1, attention_bias=True)).config.to_dict()
    with pytest.raises(ValueError, match="attention_bias"):
        ModelArgs.from_hf_config(config)


def test_token_classification_score_bias_is_refused_naming_the_tensor(tmp_path):
    """transformers' ``*ForTokenClassification`` score has a bias (``token_classification_bias``
    defaults to True); Nereus's value head has none: the load path's weight check refuses the
    directory instead of dropping the bias."""
    make_hf("LlamaForTokenClassification", dict(num_hidden_layers=1, num_labels=1)).save_pretrained(tmp_path)
    ckpt = HFCheckpoint.open(str(tmp_path))
    with pytest.raises(ModelMismatchError, match="'score.bias' is not a parameter"):
        check_against_spec(ckpt, ModelArgs.from_hf_config(ckpt.config).spec)


# ---------------------------------------------------------------- the other way: Nereus -> transformers


SHAPES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_layers=2, num_heads=4, num_kv_heads=2)
EXPORTS = {
    "llama-gqa-llama3rope": ModelArgs(spec=DecoderSpec(**SHAPES), rope_theta=5e5, rms_norm_eps=1e-5,
                                      rope_scaling=Llama3RopeScaling.from_hf(LLAMA31)),
    "qwen2-tied": ModelArgs(spec=DecoderSpec(**SHAPES, qkv_bias=True, tie_embeddings=True), model_type="qwen2", rope_theta=2e4),
    "llama-qkv-bias": ModelArgs(spec=DecoderSpec(**SHAPES, qkv_bias=True), rope_theta=2e4),
    "llama-value": ModelArgs(spec=DecoderSpec(**SHAPES, head="value"), rope_theta=2e4),
}
@pytest.mark.parametrize("name", list(EXPORTS))
def test_exported_directory_loads_into_transformers_with_every_tensor_and_equal_outputs(tmp_path, name):
    """``ModelArgs.to_hf_config`` + ``HFWriter`` (what ``nereus convert`` writes), read by the
    class its config.json names: every tensor present (a missing bias would be silently
    zero-initialised by transformers) and the outputs equal."""
    args, path = EXPORTS[name], str(tmp_path / "hf")
    model = build_model(args, "cpu").eval()
    init_weights(model, seed=0, std=0.2)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith((".bias", "norm.weight")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    entries = [(n, args.spec.dtype, tuple(shape)) for n, shape, _, _ in plan_parameters(args.spec)]
    writer, state = HFWriter(path, entries, args.to_hf_config(), sync=False), model.state_dict()
    for n, _, _ in entries:
        writer.write(n, state[n])
    writer.close()
    cls = getattr(transformers, transformers.AutoConfig.from_pretrained(path).architectures[0])
    hf, info = cls.from_pretrained(path, output_loading_info=True)
    ids, mask, pos = ids_and_masks(3, 20, [20, 13, 5], left=True)
    with torch.no_grad():
        theirs = hf.eval()(ids, attention_mask=mask.long(), position_ids=pos).logits
        mine = model(ids, attention_mask=mask)
    close(mine[mask], theirs.reshape(mine.shape)[mask])
    assert {k: v for k, v in info.items() if v} == {}
