"""``trainer/data/datasets.py``: files of every format back as written, verl's schema and the plain one,
global indices over several files, prompt-length enforcement, the sampler's positions, and
every bad input as a one-line error naming the file and the key or row. The tokenizer is the
one ``tools/make_dataset.py`` writes (digits are single tokens; a chat prompt of d digits is
d + 4 tokens, a text prompt d + 1)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nereus.trainer.config import DataConfig
from nereus.trainer.data.datasets import (
    DataError, PromptRow, PromptSampler, load_prompt_dataset, read_records, read_rows, rows_of,
)
from nereus.trainer.data.tokenizer import TokenizerError, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import make_dataset  # noqa: E402

VERL_ROWS = [
    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "12"}], "ability": "math",
     "reward_model": {"ground_truth": "72", "style": "rule"}, "extra_info": {"split": "train", "index": 0}},
    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "3"}, {"role": "assistant", "content": "4"},
                                               {"role": "user", "content": "56"}], "ability": "math",
     "reward_model": {"ground_truth": "10", "style": "rule"}, "extra_info": {"split": "train", "index": 1}},
    {"data_source": "nereus/repeat", "prompt": [{"role": "user", "content": "999"}], "ability": "copy",
     "reward_model": {"ground_truth": "999", "style": "rule"}, "extra_info": {"split": "train", "index": 2}},
]
PLAIN_ROWS = [{"question": "123", "answer": "111"}, {"question": "45", "answer": "444"}, {"question": "6", "answer": "666"}]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, str]:
    return make_dataset.make_dataset(tmp_path_factory.mktemp("made"), seed=0, train=200, val=20)


@pytest.fixture(scope="module")
def tok(made):
    return load_tokenizer(made["model"])


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path: Path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def expected_verl(rows: list[dict], first: int = 0) -> list[PromptRow]:
    return [PromptRow(index=first + i, prompt=r["prompt"], data_source=r["data_source"],
                      ground_truth=r["reward_model"]["ground_truth"], extra_info=r.get("extra_info") or {})
            for i, r in enumerate(rows)]


# ---------------------------------------------------------------- formats and schemas


@pytest.mark.parametrize("writer", [write_parquet, write_jsonl], ids=["parquet", "jsonl"])
def test_verl_rows_come_back_as_written(tmp_path, writer):
    file = writer(tmp_path / ("train.parquet" if writer is write_parquet else "train.jsonl"), VERL_ROWS)
    assert read_records(file) == VERL_ROWS  # every column, ability and style too
    rows, sources = read_rows([file])
    assert rows == expected_verl(VERL_ROWS)
    assert sources == [(file, 0, 3)]


def test_made_dataset_is_verl_schema_and_the_repeat_task(made):
    table = pq.read_table(made["train"])
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    records = table.to_pylist()
    assert len(records) == 200 and len(read_records(made["val"])) == 20
    for i, r in enumerate(records):
        digits = r["prompt"][0]["content"]
        assert r["prompt"] == [{"role": "user", "content": digits}] and len(digits) == 3 and digits.isdigit()
        assert r["reward_model"] == {"ground_truth": digits[0] * 3, "style": "rule"}
        assert r["data_source"] == "nereus/repeat" and r["extra_info"] == {"split": "train", "index": i}
    val = {r["prompt"][0]["content"] for r in read_records(made["val"])}
    assert len(val) == 20 and not val & {r["prompt"][0]["content"] for r in records}
    assert make_dataset.compute_score("nereus/repeat", "555", "555") == 1.0
    assert make_dataset.compute_score("nereus/repeat", "5555", "555") == 0.75
    assert make_dataset.compute_score("nereus/repeat", "", "555") == 0.0


def test_plain_rows_with_text_prompts_and_answer_key(tmp_path):
    file = write_jsonl(tmp_path / "mydata.jsonl", PLAIN_ROWS)
    rows, _ = read_rows([file], prompt_key="question", answer_key="answer")
    assert rows == [PromptRow(index=i, prompt=r["question"], data_source="mydata", ground_truth=r["answer"], extra_info={})
                    for i, r in enumerate(PLAIN_ROWS)]


def test_plain_parquet_with_messages_nested_answer_and_missing_extra_info(tmp_path):
    records = [{"messages": [{"role": "user", "content": "7"}], "meta": {"label": [1, 2]}, "data_source": "a"},
               {"messages": [{"role": "user", "content": "8"}], "meta": {"label": [3]}, "data_source": None}]
    file = write_parquet(tmp_path / "nested.parquet", records)
    rows, _ = read_rows([file], prompt_key="messages", answer_key="meta.label")
    assert [(r.prompt, r.data_source, r.ground_truth, r.extra_info) for r in rows] == [
        ([{"role": "user", "content": "7"}], "a", [1, 2], {}), ([{"role": "user", "content": "8"}], "nested", [3], {})]


def test_json_array_file_and_blank_lines(tmp_path):
    (tmp_path / "arr.json").write_text(json.dumps(VERL_ROWS))
    assert read_rows([str(tmp_path / "arr.json")])[0] == expected_verl(VERL_ROWS)
    (tmp_path / "gaps.jsonl").write_text("\n" + json.dumps(VERL_ROWS[0]) + "\n\n" + json.dumps(VERL_ROWS[1]) + "\n")
    assert read_rows([str(tmp_path / "gaps.jsonl")])[0] == expected_verl(VERL_ROWS[:2])


def test_numpy_values_as_pandas_gives_them_become_python_lists_and_dicts(tmp_path):
    record = {"data_source": np.str_("s"), "prompt": np.array([{"role": "user", "content": "1"}], dtype=object),
              "reward_model": {"ground_truth": np.array([1, 2]), "style": "rule"},
              "extra_info": {"index": np.int64(4), "tags": np.array(["x"], dtype=object)}}
    (row,) = rows_of([record], "f.parquet")
    assert row == PromptRow(index=0, prompt=[{"role": "user", "content": "1"}], data_source="s", ground_truth=[1, 2],
                            extra_info={"index": 4, "tags": ["x"]})
    assert type(row.prompt) is list and type(row.extra_info["index"]) is int and type(row.ground_truth) is list


def test_hf_datasets_save_to_disk_directory(tmp_path):
    import datasets  # the test extra; a missing one fails here, never skips

    path = tmp_path / "saved"
    datasets.Dataset.from_list(VERL_ROWS * 4).save_to_disk(str(path), num_shards=2)
    assert len(list(path.glob("*.arrow"))) == 2
    rows, _ = read_rows([str(path)])
    assert rows == expected_verl(VERL_ROWS * 4)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(VERL_ROWS)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"dict: a DatasetDict with splits \['train'\]: give one split's directory"):
        read_records(str(tmp_path / "dict"))
    assert read_rows([str(tmp_path / "dict" / "train")])[0] == expected_verl(VERL_ROWS)


def test_a_directory_laid_out_as_save_to_disk_without_datasets(tmp_path):
    """state.json naming Arrow IPC stream files, as datasets writes them."""
    (tmp_path / "ds").mkdir()
    for k, chunk in enumerate([VERL_ROWS[:2], VERL_ROWS[2:]]):
        table = pa.Table.from_pylist(chunk)
        with pa.OSFile(str(tmp_path / "ds" / f"data-0000{k}-of-00002.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
    files = [{"filename": f"data-0000{k}-of-00002.arrow"} for k in range(2)]
    (tmp_path / "ds" / "state.json").write_text(json.dumps({"_data_files": files}))
    assert read_rows([str(tmp_path / "ds")])[0] == expected_verl(VERL_ROWS)


def test_several_files_concatenate_with_stable_global_indices(tmp_path, tok):
    a = write_parquet(tmp_path / "a.parquet", VERL_ROWS)
    b = write_jsonl(tmp_path / "b.jsonl", VERL_ROWS[:2])
    rows, sources = read_rows([a, b])
    assert [r.index for r in rows] == [0, 1, 2, 3, 4]
    assert rows == expected_verl(VERL_ROWS) + expected_verl(VERL_ROWS[:2], first=3)
    assert sources == [(a, 0, 3), (b, 3, 2)]
    data = load_prompt_dataset([a, b], DataConfig(max_prompt_length=7, filter_overlong_prompts=True), tok)
    assert [r.index for r in data.rows] == [0, 2, 3]  # the 3-turn rows (index 1 and 4) are 12 tokens
    assert data.filtered == 2 and data.files == (a, b)


# ---------------------------------------------------------------- encoding and prompt length


def test_dataset_encodes_prompts_with_the_chat_template(made, tok):
    data = load_prompt_dataset(made["train"], DataConfig(), tok)
    assert len(data) == 200 and data.filtered == 0 and data.data_sources == ("nereus/repeat",)
    rows, ids = data.take([0, 5])
    for row, p in zip(rows, ids):
        assert p == tok.hf.apply_chat_template(row.prompt, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert len(p) == 7 and tok.decode(p) == row.prompt[0]["content"]


def test_text_prompts_are_encoded_as_plain_text(tmp_path, tok):
    file = write_jsonl(tmp_path / "plain.jsonl", PLAIN_ROWS)
    data = load_prompt_dataset(file, DataConfig(prompt_key="question", answer_key="answer"), tok)
    assert [list(p) for p in data.prompt_ids] == [tok.hf(r["question"])["input_ids"] for r in PLAIN_ROWS]


def test_overlong_prompt_is_an_error_naming_file_row_and_length(tmp_path, tok):
    rows = [dict(VERL_ROWS[0], prompt=[{"role": "user", "content": "1" * n}]) for n in (2, 9, 3, 12)]
    a = write_jsonl(tmp_path / "first.jsonl", VERL_ROWS[:1])
    b = write_jsonl(tmp_path / "second.jsonl", rows)
    with pytest.raises(DataError, match=r"second\.jsonl: row 1 \(index 2\): the prompt is 13 tokens, over "
                                        r"data\.max_prompt_length=8 \(2 of 5 rows are\)") as e:
        load_prompt_dataset([a, b], DataConfig(max_prompt_length=8), tok)
    assert "filter_overlong_prompts" in str(e.value) and "\n" not in str(e.value)
    data = load_prompt_dataset([a, b], DataConfig(max_prompt_length=8, filter_overlong_prompts=True), tok)
    assert data.filtered == 2 and [r.index for r in data.rows] == [0, 1, 3]
    assert max(map(len, data.prompt_ids)) <= 8
    assert len(load_prompt_dataset([a, b], DataConfig(max_prompt_length=16), tok)) == 5  # the limit is inclusive
    with pytest.raises(DataError, match=r"every one of the 5 prompts is longer than data\.max_prompt_length=3"):
        load_prompt_dataset([a, b], DataConfig(max_prompt_length=3, filter_overlong_prompts=True), tok)


def test_encoding_ten_thousand_rows_takes_seconds(tmp_path, tok):
    import time

    train, _ = make_dataset.make_rows(1, 10_000, 0)
    file = write_parquet(tmp_path / "big.parquet", train)
    start = time.perf_counter()
    data = load_prompt_dataset(file, DataConfig(), tok)
    assert len(data) == 10_000 and time.perf_counter() - start < 20


# ---------------------------------------------------------------- the sampler


def test_each_epoch_visits_every_row_once_in_a_seeded_order():
    s = PromptSampler(10, seed=7)
    epochs = [s.indices(10 * e, 10) for e in range(4)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4  # a new permutation each epoch
    assert PromptSampler(10, seed=7).indices(0, 40) == sum(epochs, [])  # deterministic
    assert PromptSampler(10, seed=8).indices(0, 10) != epochs[0]
    assert [s.epoch_of(p) for p in (0, 9, 10, 39)] == [0, 0, 1, 3]


def test_a_step_across_the_epoch_boundary_takes_the_end_and_the_next_start():
    s = PromptSampler(7, seed=1)
    assert s.indices(5, 4) == s.permutation(0)[5:] + s.permutation(1)[:2]
    assert s.indices(3, 16) == s.permutation(0)[3:] + s.permutation(1) + s.permutation(2)[:5]
    counts = Counter(s.indices(0, 70))
    assert set(counts.values()) == {10}


def test_without_shuffle_every_epoch_is_the_identity():
    s = PromptSampler(5, seed=3, shuffle=False)
    assert s.indices(0, 12) == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]


def test_positions_do_not_depend_on_how_draws_are_split():
    """A resume at another replica count draws from the saved position: any split of the
    positions into steps gives the same rows (every rank draws the step's full list)."""
    s = PromptSampler(13, seed=5)
    whole = s.indices(0, 100)
    for step in (1, 4, 8, 13, 24):
        fresh = PromptSampler(13, seed=5)  # as after a restart
        assert sum((fresh.indices(a, min(step, 100 - a)) for a in range(0, 100, step)), []) == whole
    for a, k, m in [(0, 3, 20), (11, 2, 1), (25, 13, 13), (99, 0, 5)]:
        assert s.indices(a, k) + s.indices(a + k, m) == s.indices(a, k + m)


def test_sampler_rejects_no_rows_and_negative_positions():
    with pytest.raises(ValueError, match="at least one row"):
        PromptSampler(0, seed=0)
    with pytest.raises(ValueError, match="non-negative"):
        PromptSampler(3, seed=0).indices(-1, 2)


# ---------------------------------------------------------------- bad input


def test_missing_file_and_unknown_format_name_the_file(tmp_path):
    with pytest.raises(DataError, match=r"nothere\.parquet: no such data file"):
        read_rows([str(tmp_path / "nothere.parquet")])
    (tmp_path / "data.csv").write_text("prompt\nx\n")
    with pytest.raises(DataError, match=r"data\.csv: unknown data format '\.csv'"):
        read_rows([str(tmp_path / "data.csv")])
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(DataError, match=r"plain_dir: a directory, but not one written by datasets' save_to_disk"):
        read_rows([str(tmp_path / "plain_dir")])
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"broken\.parquet: not a readable parquet file"):
        read_rows([str(tmp_path / "broken.parquet")])
    (tmp_path / "bad.jsonl").write_text(json.dumps(VERL_ROWS[0]) + "\n{oops\n")
    with pytest.raises(DataError, match=r"bad\.jsonl: line 2 is not valid JSON"):
        read_rows([str(tmp_path / "bad.jsonl")])
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    with pytest.raises(DataError, match=r"list\.jsonl: line 1 is a JSON list, not an object"):
        read_rows([str(tmp_path / "list.jsonl")])


def test_missing_keys_name_the_file_the_key_and_the_row(tmp_path):
    file = write_jsonl(tmp_path / "plain.jsonl", PLAIN_ROWS)
    with pytest.raises(DataError, match=r"plain\.jsonl: no 'prompt' in any row \(data\.prompt_key\); the rows have \['answer', 'question'\]"):
        read_rows([file])
    with pytest.raises(DataError, match=r"plain\.jsonl: no 'reward_model\.ground_truth' in any row .*set data\.answer_key"):
        read_rows([file], prompt_key="question")
    with pytest.raises(DataError, match=r"plain\.jsonl: no 'label' in any row \(data\.answer_key\)"):
        read_rows([file], prompt_key="question", answer_key="label")
    some = write_jsonl(tmp_path / "some.jsonl", [PLAIN_ROWS[0], {"question": "1"}, PLAIN_ROWS[1], {"question": "2"}])
    with pytest.raises(DataError, match=r"some\.jsonl: row 1 has no 'answer' \(data\.answer_key\); 2 of 4 rows lack it"):
        read_rows([some], prompt_key="question", answer_key="answer")
    verl = write_parquet(tmp_path / "verl.parquet", [VERL_ROWS[0], dict(VERL_ROWS[1], reward_model=None)])
    with pytest.raises(DataError, match=r"verl\.parquet: row 1 has no 'reward_model\.ground_truth'"):
        read_rows([verl])


def test_malformed_prompts_and_extra_info_name_the_row(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [VERL_ROWS[0], dict(VERL_ROWS[0], prompt=[{"role": "user"}])])
    with pytest.raises(DataError, match=r"bad\.jsonl: row 1: 'prompt' must be text or chat messages"):
        read_rows([bad])
    empty = write_jsonl(tmp_path / "empty.jsonl", [dict(VERL_ROWS[0], prompt=[])])
    with pytest.raises(DataError, match=r"empty\.jsonl: row 0: 'prompt' must be text or chat messages"):
        read_rows([empty])
    extra = write_jsonl(tmp_path / "extra.jsonl", [dict(VERL_ROWS[0], extra_info="x")])
    with pytest.raises(DataError, match=r"extra\.jsonl: row 0: 'extra_info' must be an object, got str"):
        read_rows([extra])


def test_no_files_and_no_rows_are_errors(tmp_path, tok):
    with pytest.raises(DataError, match="no data files given"):
        load_prompt_dataset([], DataConfig(), tok)
    empty = write_jsonl(tmp_path / "nothing.jsonl", [])
    with pytest.raises(DataError, match=r"nothing\.jsonl: no rows"):
        load_prompt_dataset(empty, DataConfig(), tok)


def test_messages_without_a_chat_template_name_the_tokenizer_and_the_row(made, tmp_path, tok):
    model = tmp_path / "notemplate"
    model.mkdir()
    for name in ("tokenizer.json", "generation_config.json"):
        (model / name).write_bytes(Path(made["model"], name).read_bytes())
    config = json.loads(Path(made["model"], "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    file = write_jsonl(tmp_path / "mixed.jsonl", [dict(VERL_ROWS[0], prompt="12"), VERL_ROWS[0]])
    with pytest.raises(TokenizerError, match=r"notemplate: the tokenizer has no chat template.*mixed\.jsonl: row 1 gives"):
        load_prompt_dataset(file, DataConfig(), load_tokenizer(model))


def test_a_prompt_the_template_refuses_names_the_row(tmp_path, tok):
    rows = [VERL_ROWS[0], dict(VERL_ROWS[0], prompt=[{"role": "system", "content": "1"}])]
    file = write_jsonl(tmp_path / "roles.jsonl", rows)
    with pytest.raises(DataError, match=r"roles\.jsonl: row 1: the prompt cannot be encoded: .*not system"):
        load_prompt_dataset(file, DataConfig(), tok)



def test_make_dataset_command_line_writes_and_rewrites_the_same_files(tmp_path, capsys):
    out = tmp_path / "cli"
    make_dataset.main(["--out", str(out), "--seed", "2", "--train", "8", "--val", "4"])
    paths = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in out.iterdir()) == ["model", "train.parquet", "val.parquet"]
    first = {p.name: p.read_bytes() for p in Path(paths["model"]).iterdir()}
    make_dataset.main(["--out", str(out), "--seed", "2", "--train", "8", "--val", "4"])  # over its own output
    assert {p.name: p.read_bytes() for p in Path(paths["model"]).iterdir()} == first
    assert sorted(p.name for p in out.iterdir()) == ["model", "train.parquet", "val.parquet"]
    assert len(read_records(paths["train"])) == 8 and len(read_records(paths["val"])) == 4
    with pytest.raises(SystemExit):
        make_dataset.main(["--out", str(out), "--val", "501"])
    assert "--val must be between 0 and 500" in capsys.readouterr().err
