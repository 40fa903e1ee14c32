"""``trainer/data/tokenizer.py`` against transformers' own tokenizer, and the model directory that
``tools/make_dataset.py`` writes: it loads through the project's HF reader and through
``transformers.LlamaForCausalLM`` with the same logits (|ours - theirs| <= 1e-5 + 1e-5 |theirs|,
float32 on both sides, as ``test_hf_parity.py``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from nereus.store.hf import HFCheckpoint, check_against_spec
from nereus.trainer.runtime.checkpoint import check_forward_settings
from nereus.trainer.models.decoder import ModelArgs, build_model
from nereus.trainer.data.tokenizer import TokenizerError, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import make_dataset  # noqa: E402

CHAT = [{"role": "user", "content": "572"}]
MULTI_TURN = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "111"}, {"role": "user", "content": "90 4"}]

# A Llama-3-shaped tokenizer: byte-level BPE, a BOS added to plain text by the post-processor,
# a header-style chat template that writes the BOS itself, and two stop tokens.
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CORPUS = ["You are a helpful assistant.", "What is 12 + 30? Answer: 42", "Natalia sold clips to 48 of her friends.",
          "system user assistant", "The quick brown fox jumps over the lazy dog."] * 20


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, str]:
    return make_dataset.make_dataset(tmp_path_factory.mktemp("made"), seed=3, train=64, val=16)


def write_llama3_like(path: Path, *, generation_eos, template: str | None = LLAMA3_TEMPLATE, pad: bool = False) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=LLAMA3_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    if template is not None:
        config["chat_template"] = template
    if pad:
        config["pad_token"] = "<|end_of_text|>"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


def ids(hf: transformers.PreTrainedTokenizerBase, token: str) -> int:
    return hf.convert_tokens_to_ids(token)


# ---------------------------------------------------------------- chat templates against transformers


@pytest.mark.parametrize("messages", [CHAT, MULTI_TURN], ids=["one-turn", "multi-turn"])
def test_chat_prompt_ids_equal_transformers_apply_chat_template(made, tmp_path, messages):
    for path in (made["model"], write_llama3_like(tmp_path / "llama3", generation_eos=None)):
        ours = load_tokenizer(path)
        hf = transformers.AutoTokenizer.from_pretrained(path)
        theirs = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ours.encode_prompt(messages) == list(theirs)
        assert ours.encode_prompts([messages, "plain"])[0] == list(theirs)
        assert theirs.count(hf.bos_token_id) == 1  # the template's BOS, not a second one from the post-processor


def test_made_tokenizer_renders_the_user_turn_and_the_assistant_header(made):
    tok = load_tokenizer(made["model"])
    assert tok.render(CHAT) == "<|bos|><|user|>572<|end|><|assistant|>"
    hf = tok.hf
    expected = [ids(hf, t) for t in ("<|bos|>", "<|user|>", "5", "7", "2", "<|end|>", "<|assistant|>")]
    assert tok.encode_prompt(CHAT) == expected


def test_plain_text_is_tokenized_as_the_tokenizer_does_by_default(made, tmp_path):
    for path in (made["model"], write_llama3_like(tmp_path / "llama3", generation_eos=None)):
        tok, hf = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
        for text in ("572", "What is 12 + 30?"):
            assert tok.encode_prompt(text) == hf(text)["input_ids"]
            assert tok.encode_prompt(text)[0] == tok.bos_id
    tok = load_tokenizer(made["model"])
    assert tok.encode_prompt("9 8") == [tok.bos_id, ids(tok.hf, "9"), ids(tok.hf, "8")]  # whitespace splits, no token


def test_digits_are_single_tokens_and_decode_skips_special_tokens(made):
    tok = load_tokenizer(made["model"])
    assert tok.encode_prompt("0123456789")[1:] == [ids(tok.hf, d) for d in "0123456789"]
    assert len(set(tok.encode_prompt("0123456789"))) == 11
    response = [ids(tok.hf, "5")] * 3 + [tok.eos_ids[0], tok.pad_id, tok.pad_id]
    assert tok.decode(response) == "555"
    assert tok.decode([tok.eos_ids[0], tok.pad_id]) == ""


def test_made_tokenizer_ids_sizes_and_stop_tokens(made):
    tok = load_tokenizer(made["model"])
    hf = transformers.AutoTokenizer.from_pretrained(made["model"])
    assert tok.vocab_size == len(hf) == 16
    assert tok.eos_ids == (ids(hf, "<|end|>"),) and tok.pad_id == ids(hf, "<|pad|>") and tok.bos_id == ids(hf, "<|bos|>")
    with open(os.path.join(made["model"], "config.json")) as f:
        assert json.load(f)["vocab_size"] == tok.vocab_size


# ---------------------------------------------------------------- stop and pad tokens


def test_eos_ids_from_generation_config_as_an_int_and_as_a_list(tmp_path):
    one = load_tokenizer(write_llama3_like(tmp_path / "int", generation_eos=None))
    eot, end = ids(one.hf, "<|eot_id|>"), ids(one.hf, "<|end_of_text|>")
    assert one.eos_ids == (eot,)
    assert load_tokenizer(write_llama3_like(tmp_path / "int2", generation_eos=end)).eos_ids == (eot, end)
    assert load_tokenizer(write_llama3_like(tmp_path / "same", generation_eos=eot)).eos_ids == (eot,)
    listed = load_tokenizer(write_llama3_like(tmp_path / "list", generation_eos=[end, eot]))
    assert listed.eos_ids == (eot, end)  # the tokenizer's first, no repeats
    assert listed.pad_id == eot  # no pad token: the first stop token
    assert load_tokenizer(write_llama3_like(tmp_path / "pad", generation_eos=None, pad=True)).pad_id == end


def test_bad_generation_config_eos_is_an_error_naming_the_file(tmp_path):
    path = write_llama3_like(tmp_path / "bad", generation_eos=["x"])
    with pytest.raises(TokenizerError, match=r"generation_config\.json: eos_token_id must be an int"):
        load_tokenizer(path)
    path = write_llama3_like(tmp_path / "far", generation_eos=[10**6])
    with pytest.raises(TokenizerError, match=r"far: eos token id 1000000 is outside the vocabulary"):
        load_tokenizer(path)


def test_a_tokenizer_without_any_stop_token_is_refused(tmp_path):
    path = write_llama3_like(tmp_path / "noeos", generation_eos=None)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["eos_token"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="noeos: no stop token"):
        load_tokenizer(path)


# ---------------------------------------------------------------- bad input


def test_missing_directory_file_and_empty_directory_are_errors_naming_the_path(tmp_path):
    with pytest.raises(TokenizerError, match=r"nowhere: no such tokenizer directory"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(TokenizerError, match=r"a_file: no such tokenizer directory \(it is a file\)"):
        load_tokenizer(tmp_path / "a_file")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"empty: no tokenizer files"):
        load_tokenizer(tmp_path / "empty")


def test_an_unloadable_tokenizer_is_one_line_naming_the_directory(made, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(made["model"], broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"broken: transformers could not load the tokenizer") as e:
        load_tokenizer(broken)
    assert "\n" not in str(e.value)


def test_chat_messages_without_a_chat_template_name_the_tokenizer(tmp_path):
    path = write_llama3_like(tmp_path / "notemplate", generation_eos=None, template=None)
    tok = load_tokenizer(path)
    assert not tok.has_chat_template
    assert tok.encode_prompt("text works")[0] == tok.bos_id
    with pytest.raises(TokenizerError, match=r"notemplate: the tokenizer has no chat template"):
        tok.encode_prompt(CHAT)


def test_a_role_the_template_refuses_raises(made):
    with pytest.raises(Exception, match="not system"):
        load_tokenizer(made["model"]).encode_prompt([{"role": "system", "content": "1"}])


# ---------------------------------------------------------------- the model directory


def test_made_model_loads_through_the_project_reader_and_transformers_with_equal_logits(made):
    path = made["model"]
    ckpt = HFCheckpoint.open(path)
    args = ModelArgs.from_hf_config(ckpt.config)
    check_against_spec(ckpt, args.spec)
    check_forward_settings(args, ckpt.config, path)
    spec = args.spec
    assert (spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.dim_head) == (
        64, 192, 2, 4, 2, 16)
    assert (spec.vocab_size, spec.tie_embeddings, spec.dtype, args.max_seq_len) == (16, False, "float32", 64)
    ours = build_model(args, "cpu").eval()
    ours.load_state_dict({n: ckpt.read(n) for n in ckpt.tensors}, strict=True)
    hf, info = transformers.LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    tok = load_tokenizer(path)
    prompt = torch.tensor([tok.encode_prompt(CHAT) + tok.encode_prompt("98765")[1:]])
    with torch.no_grad():
        mine, theirs = ours(prompt), hf.eval()(prompt).logits
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    assert theirs.std() > 1e-3  # random weights: not a degenerate all-equal output


def test_made_weights_are_seeded_normal_matrices_and_unit_norms(made, tmp_path):
    ckpt = HFCheckpoint.open(made["model"])
    names = set(ckpt.tensors)
    assert {"model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"} <= names
    for name in names:
        t = ckpt.read(name)
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        else:
            assert abs(t.std().item() - 0.05) < 0.01 and abs(t.mean().item()) < 0.01, name
    again = make_dataset.make_dataset(tmp_path / "again", seed=3, train=64, val=16)
    other = make_dataset.make_dataset(tmp_path / "other", seed=4, train=64, val=16)
    digest = lambda d, f: hashlib.sha256(Path(d, f).read_bytes()).hexdigest()  # noqa: E731
    for key, file in [("model", "model.safetensors"), ("model", "tokenizer.json"), ("model", "config.json"),
                      ("train", ""), ("val", "")]:
        assert digest(again[key], file) == digest(made[key], file), (key, file)
    assert digest(other["model"], "model.safetensors") != digest(made["model"], "model.safetensors")
    assert digest(other["train"], "") != digest(made["train"], "")
