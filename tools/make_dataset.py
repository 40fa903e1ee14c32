"""Write a small RL dataset in verl's parquet schema and a tiny HF model directory for it.

    python tools/make_dataset.py --out DIR [--seed 0] [--train 2048 --val 128]

Nothing is downloaded; the same arguments write the same files. ``DIR`` gets:

- ``train.parquet``, ``val.parquet``: verl's schema as its GSM8K preprocessing writes it,
  one row per prompt: ``data_source`` ("nereus/repeat"), ``prompt`` (chat messages:
  ``[{"role": "user", "content": "572"}]``), ``ability`` ("copy"), ``reward_model``
  (``{"ground_truth": "555", "style": "rule"}``), ``extra_info`` (``{"split", "index"}``).
  The task is the toy ``repeat`` of ``trainer/data/tasks.py`` over text: the answer is the
  first of the prompt's 3 digits repeated 3 times. Validation prompts are a seeded set
  of distinct digit strings that no training row uses (``--val`` <= 500); training rows
  are drawn uniformly, with replacement, from the other strings.
- ``model/``: a HF Llama directory that ``transformers`` and ``store.hf.HFCheckpoint`` load:
  ``config.json`` (LlamaForCausalLM: hidden 64, intermediate 192, 2 layers, 4 heads / 2 KV
  heads of 16, untied, float32, 64 positions); ``tokenizer.json`` + ``tokenizer_config.json``:
  a WordLevel tokenizer trained here with ``tokenizers`` on the dataset's text, every digit
  one token, 16 tokens in all (``<|pad|> <|unk|> <|bos|> <|end|> <|user|> <|assistant|>``
  then the digits, by frequency), so TP degrees 1, 2, 4, 8, 16 split the vocabulary; plain
  text is encoded with a leading ``<|bos|>``; its Jinja ``chat_template`` renders
  ``<|bos|><|user|>572<|end|><|assistant|>`` for a user turn with the generation prompt
  (7 tokens) and an assistant turn as ``<|assistant|>555<|end|>``; ``generation_config.json``
  (``eos_token_id``: ``<|end|>``); ``model.safetensors``: random weights with HF Llama names,
  N(0, 0.05^2) for every matrix (embedding and head too) and ones for the RMSNorm weights,
  drawn in ``reshard.derive.plan_parameters`` order from one ``torch.Generator`` seeded with
  ``--seed``; written through ``store.hf.HFWriter`` (a temporary directory renamed into place).

The task's reward function is ``tools/repeat_reward.py:compute_score`` (re-exported here).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from nereus.reshard.derive import DecoderSpec, plan_parameters  # noqa: E402
from nereus.store.hf import HFWriter  # noqa: E402
from tools.repeat_reward import compute_score  # noqa: E402,F401 - the task's reward, re-exported

DATA_SOURCE = "nereus/repeat"
DIGITS = 3  # prompt digits
ANSWER_LEN = 3  # the first digit, this many times
PAD, UNK, BOS, END, USER, ASSISTANT = "<|pad|>", "<|unk|>", "<|bos|>", "<|end|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = (PAD, UNK, BOS, END, USER, ASSISTANT)  # ids 0..5, in this order
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' + message['content'] + '<|end|>' }}"
    "{% else %}{{ raise_exception('this chat template knows the roles user and assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
MODEL_SHAPES = dict(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
MAX_POSITIONS = 64
INIT_STD = 0.05


def answer(prompt: str) -> str:
    return prompt[0] * ANSWER_LEN


def make_rows(seed: int, train: int, val: int) -> tuple[list[dict], list[dict]]:
    """The train and val rows in verl's schema (pure): val prompts distinct and unseen in train."""
    pool = [f"{i:0{DIGITS}d}" for i in range(10**DIGITS)]
    if not 0 <= val <= len(pool) // 2:
        raise ValueError(f"--val must be between 0 and {len(pool) // 2}, got {val}")
    if train < 1:
        raise ValueError(f"--train must be at least 1, got {train}")
    rng = random.Random(seed)
    rng.shuffle(pool)
    val_prompts, rest = pool[:val], pool[val:]
    train_prompts = [rng.choice(rest) for _ in range(train)]

    def row(split: str, index: int, prompt: str) -> dict:
        return {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt}],
            "ability": "copy",
            "reward_model": {"ground_truth": answer(prompt), "style": "rule"},
            "extra_info": {"split": split, "index": index},
        }

    return ([row("train", i, p) for i, p in enumerate(train_prompts)],
            [row("val", i, p) for i, p in enumerate(val_prompts)])


def write_parquet(rows: list[dict], path: str) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path)


def build_tokenizer(texts: list[str]):
    """A ``tokenizers.Tokenizer``: WordLevel over single digits, trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tok.decoder = decoders.Fuse()  # tokens are joined without spaces: "5","5","5" -> "555"
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS), min_frequency=1, show_progress=False)
    tok.train_from_iterator(["0123456789", *texts], trainer)  # every digit, whatever the data holds
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, bos)]
    )
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(len(SPECIAL_TOKENS))), ids
    return tok


def tokenizer_files(tok) -> dict[str, bytes]:
    """``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json`` as bytes."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": END, "pad_token": PAD, "unk_token": UNK,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
    }
    generation = {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(END),
                  "pad_token_id": tok.token_to_id(PAD)}
    dump = lambda d: (json.dumps(d, indent=2, sort_keys=True) + "\n").encode()  # noqa: E731
    return {"tokenizer.json": tok.to_str(pretty=True).encode(), "tokenizer_config.json": dump(config),
            "generation_config.json": dump(generation)}


def model_config(vocab_size: int, tok) -> dict:
    s = MODEL_SHAPES
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": s["num_layers"], "num_attention_heads": s["num_heads"],
        "num_key_value_heads": s["num_kv_heads"], "head_dim": s["head_dim"],
        "hidden_act": "silu", "max_position_embeddings": MAX_POSITIONS, "rope_theta": 10000.0,
        "rope_scaling": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32",
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "initializer_range": INIT_STD,
        "bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(END), "pad_token_id": tok.token_to_id(PAD),
        "use_cache": True,
    }


def write_model(path: str, tok, seed: int) -> None:
    """The model directory: config, tokenizer files and seeded random weights (HFWriter)."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    config = model_config(vocab, tok)
    spec = DecoderSpec.from_hf_config(config)
    entries = [(name, spec.dtype, tuple(shape)) for name, shape, _, _ in plan_parameters(spec)]
    g = torch.Generator().manual_seed(seed)
    writer = HFWriter(path, entries, config, overwrite=True, sync=False, side_files=tokenizer_files(tok))
    try:
        for name, _, shape in entries:
            if name.endswith("norm.weight"):
                tensor = torch.ones(shape)
            else:
                tensor = INIT_STD * torch.randn(shape, generator=g)
            writer.write(name, tensor)
    except BaseException:
        writer.abort()
        raise
    writer.close()


def make_dataset(out: str | os.PathLike, seed: int = 0, train: int = 2048, val: int = 128) -> dict[str, str]:
    """Write ``train.parquet``, ``val.parquet`` and ``model/`` under ``out``; their paths by name."""
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    train_rows, val_rows = make_rows(seed, train, val)
    paths = {"train": os.path.join(out, "train.parquet"), "val": os.path.join(out, "val.parquet"),
             "model": os.path.join(out, "model")}
    write_parquet(train_rows, paths["train"])
    write_parquet(val_rows, paths["val"])
    texts = [m["content"] for r in train_rows + val_rows for m in r["prompt"]]
    texts += [r["reward_model"]["ground_truth"] for r in train_rows]
    write_model(paths["model"], build_tokenizer(texts), seed)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write into (created if absent)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=2048, help="training rows")
    parser.add_argument("--val", type=int, default=128, help="validation rows (distinct prompts, at most 500)")
    args = parser.parse_args(argv)
    try:
        paths = make_dataset(args.out, seed=args.seed, train=args.train, val=args.val)
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(paths))


if __name__ == "__main__":
    main()
