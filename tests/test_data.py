"""Data module: sample sets, GSM8K conversion, parquet loading, tokenized prompts and the batch sampler."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from backend.core.data import (
    ARITHMETIC_INSTRUCTION,
    GSM8K_INSTRUCTION,
    DataError,
    PromptDataset,
    PromptSampler,
    convert_gsm8k,
    gsm8k_rows_from_jsonl,
    load_many,
    load_rows,
    make_arithmetic_rows,
    write_rows,
    write_sample_sets,
)

SHARED = Path(__file__).resolve().parents[2] / "shared"
GSM8K_TRAIN = SHARED / "data/gsm8k/train.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHARED / "models/smollm2-tokenizer")


def _verl_row(content: str, ground_truth: str = "1", data_source: str = "test") -> dict:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": "train", "index": 0},
    }


# ---- sample sets ----


def test_sample_rows_are_the_same_for_a_seed_and_differ_for_another_seed():
    assert make_arithmetic_rows(50, seed=3, split="train") == make_arithmetic_rows(50, seed=3, split="train")
    assert make_arithmetic_rows(50, seed=3, split="train") != make_arithmetic_rows(50, seed=4, split="train")


def test_sample_set_files_are_deterministic_and_no_val_question_appears_in_train(tmp_path):
    a = write_sample_sets(tmp_path / "a", seed=1, n_train=500, n_val=100)
    b = write_sample_sets(tmp_path / "b", seed=1, n_train=500, n_val=100)
    assert a["train"].name == "arithmetic_train.parquet" and a["val"].name == "arithmetic_val.parquet"
    train, val = load_rows(a["train"]), load_rows(a["val"])
    assert (len(train), len(val)) == (500, 100)
    assert train == load_rows(b["train"]) and val == load_rows(b["val"])
    train_prompts = {r["prompt"][0]["content"] for r in train}
    assert not train_prompts & {r["prompt"][0]["content"] for r in val}
    assert [r["extra_info"]["index"] for r in val] == list(range(100))
    assert {r["extra_info"]["split"] for r in val} == {"val"}


def test_every_sample_row_is_well_formed_with_the_right_integer_answer_and_a_level():
    rows = make_arithmetic_rows(1000, seed=0, split="train")
    levels = [r["extra_info"]["level"] for r in rows]
    for row in rows:
        assert row["data_source"] == "arithmetic" and row["ability"] == "math"
        assert row["reward_model"]["style"] == "rule"
        ground_truth = row["reward_model"]["ground_truth"]
        assert ground_truth.lstrip("-").isdigit()
        a, op, b = row["extra_info"]["expression"].split()
        assert int(ground_truth) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
        if row["extra_info"]["level"] == 1:
            assert op == "+" and int(a) < 10 and int(b) < 10
        (message,) = row["prompt"]
        assert message["role"] == "user" and message["content"].endswith(ARITHMETIC_INSTRUCTION)
    # mostly the easy level, but every level present
    assert set(levels) == {1, 2, 3}
    assert levels.count(1) > levels.count(2) > 0 and levels.count(1) > levels.count(3) > 0


def test_sample_prompts_are_under_80_tokens_with_the_chat_template(tokenizer):
    dataset = PromptDataset(make_arithmetic_rows(300, seed=0, split="train"), tokenizer, max_prompt_length=80)
    assert len(dataset) == 300 and dataset.n_filtered == 0
    assert max(dataset.prompt_lengths()) < 80
    assert dataset[0]["prompt_text"].endswith("<|im_start|>assistant\n")


# ---- GSM8K ----


def test_gsm8k_conversion_of_the_real_file_gives_the_known_ground_truth(tmp_path):
    out = tmp_path / "gsm8k_train.parquet"
    assert convert_gsm8k(GSM8K_TRAIN, out, split="train", limit=50) == 50
    rows = load_rows(out)
    assert len(rows) == 50
    with open(GSM8K_TRAIN) as f:
        first = json.loads(f.readline())
    assert first["answer"].endswith("#### 72")
    row = rows[0]
    assert row["data_source"] == "openai/gsm8k"
    assert row["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert row["prompt"] == [{"role": "user", "content": f"{first['question']} {GSM8K_INSTRUCTION}"}]
    assert row["extra_info"]["answer"] == first["answer"]
    assert row["extra_info"]["question"] == first["question"]
    assert (row["extra_info"]["split"], row["extra_info"]["index"]) == ("train", 0)
    assert rows[49]["extra_info"]["index"] == 49


def test_gsm8k_ground_truth_drops_thousands_separators(tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text(
        json.dumps({"question": "How many?", "answer": "It is 1,000 + 234.\n#### 1,234"})
        + "\n\n"
        + json.dumps({"question": "Below zero?", "answer": "#### -5"})
        + "\n"
    )
    rows = gsm8k_rows_from_jsonl(path, split="val")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["1234", "-5"]
    assert rows[1]["extra_info"]["split"] == "val"


def test_gsm8k_bad_json_line_error_names_the_file_and_line_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + '{"question": "q", "ans\n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 2: not valid JSON"):
        gsm8k_rows_from_jsonl(path)


def test_gsm8k_answer_without_a_marker_error_names_the_line(tmp_path):
    path = tmp_path / "nomarker.jsonl"
    lines = [{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "#### 2"}]
    lines.append({"question": "q", "answer": "the answer is 3"})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(DataError, match=r"nomarker\.jsonl line 3: .*####"):
        gsm8k_rows_from_jsonl(path)


# ---- loading parquet ----


def test_load_rows_of_a_non_parquet_file_says_only_parquet_is_read(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    with pytest.raises(DataError, match=r"rows\.jsonl is not a parquet file; only parquet is read") as info:
        load_rows(path)
    assert "Traceback" not in str(info.value)


def test_load_rows_of_an_empty_parquet_file_says_it_is_empty(tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(
        pa.table({"data_source": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}), path
    )
    with pytest.raises(DataError, match=r"empty\.parquet: file is empty \(0 rows\)"):
        load_rows(path)


def test_load_rows_names_a_missing_prompt_column_and_the_columns_found(tmp_path):
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"a": [1], "b": ["x"]}), path)
    with pytest.raises(
        DataError, match=r"x\.parquet: missing column 'prompt' \(found: a, b\); expected verl"
    ):
        load_rows(path)


def test_load_rows_names_the_row_with_a_null_prompt(tmp_path):
    rows = [_verl_row(f"question {i}") for i in range(20)]
    path = tmp_path / "x.parquet"
    write_rows(rows, path)
    table = pq.read_table(path)
    prompts = table.column("prompt").to_pylist()
    prompts[17] = None
    table = table.set_column(
        table.column_names.index("prompt"), "prompt", pa.array(prompts, table.schema.field("prompt").type)
    )
    pq.write_table(table, path)
    with pytest.raises(DataError, match=r"x\.parquet row 17: prompt is null"):
        load_rows(path)


def test_load_rows_rejects_a_prompt_of_the_wrong_type_naming_the_type(tmp_path):
    path = tmp_path / "x.parquet"
    pq.write_table(
        pa.table({"data_source": ["d"] * 4, "prompt": [1, 2, 3, 4], "ground_truth": ["1"] * 4}), path
    )
    with pytest.raises(
        DataError, match=r"row 0: prompt must be a list of \{role, content\} messages or a string, got int"
    ):
        load_rows(path)


def test_load_rows_rejects_a_message_with_an_unknown_role_listing_the_allowed_roles(tmp_path):
    row = _verl_row("hi")
    row["prompt"] = [{"role": "narrator", "content": "hi"}]
    path = tmp_path / "x.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    with pytest.raises(
        DataError, match=r"row 0: prompt message 0 has role 'narrator'; allowed roles: system, user"
    ):
        load_rows(path)


def test_load_rows_accepts_a_string_prompt_and_an_answer_column_and_normalises_them(tmp_path):
    path = tmp_path / "plain.parquet"
    table = pa.table(
        {
            "data_source": ["openai/gsm8k", "openai/gsm8k"],
            "prompt": ["What is 2 + 2?", "What is 1,000 + 1?"],
            "answer": ["2 + 2 = 4\n#### 4", "#### 1,001"],
        }
    )
    pq.write_table(table, path)
    rows = load_rows(path)
    assert rows[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "ability": "unknown",
        "reward_model": {"style": "rule", "ground_truth": "4"},
        "extra_info": {"index": 0},
    }
    assert rows[1]["reward_model"]["ground_truth"] == "1001"


def test_load_rows_takes_a_top_level_ground_truth_column_and_turns_numbers_into_strings(tmp_path):
    path = tmp_path / "gt.parquet"
    pq.write_table(
        pa.table({"data_source": ["d", "d"], "prompt": ["a", "b"], "ground_truth": [42.0, 0.5]}), path
    )
    assert [r["reward_model"]["ground_truth"] for r in load_rows(path)] == ["42", "0.5"]


def test_load_rows_requires_data_source_unless_a_default_is_given(tmp_path):
    path = tmp_path / "nosource.parquet"
    pq.write_table(pa.table({"prompt": ["hi"], "ground_truth": ["1"]}), path)
    with pytest.raises(
        DataError, match=r"nosource\.parquet: missing column 'data_source' \(found: prompt, ground_truth\)"
    ):
        load_rows(path)
    assert load_rows(path, default_data_source="arithmetic")[0]["data_source"] == "arithmetic"


def test_load_rows_without_any_ground_truth_column_says_which_columns_are_accepted(tmp_path):
    path = tmp_path / "nogt.parquet"
    pq.write_table(pa.table({"data_source": ["d"], "prompt": ["hi"]}), path)
    with pytest.raises(DataError, match=r"missing column 'reward_model' .*ground_truth or answer column"):
        load_rows(path)


def test_written_verl_rows_load_back_unchanged_and_load_many_keeps_file_order(tmp_path):
    first = make_arithmetic_rows(5, seed=0, split="train")
    second = [_verl_row("a longer question?", ground_truth="12", data_source="other")]
    write_rows(first, tmp_path / "first.parquet")
    write_rows(second, tmp_path / "second.parquet")
    assert load_rows(tmp_path / "first.parquet") == first
    rows = load_many([str(tmp_path / "first.parquet"), str(tmp_path / "second.parquet")])
    assert rows == first + second
    with pytest.raises(DataError, match="no data files given"):
        load_many([])


# ---- PromptDataset ----


def _long_rows() -> list[dict]:
    return [
        _verl_row("short question"),
        _verl_row(" ".join(f"word{i}" for i in range(200))),
        _verl_row("2 + 2?"),
    ]


def test_an_overlong_prompt_error_names_the_file_row_length_limit_and_both_fixes(tokenizer):
    with pytest.raises(DataError) as info:
        PromptDataset(_long_rows(), tokenizer, max_prompt_length=64, source="data/x.parquet")
    message = str(info.value)
    assert message.startswith("data/x.parquet row 1: prompt is ")
    assert "data.max_prompt_length=64" in message
    assert "data.filter_overlong_prompts=true" in message and "data.truncation=left|right" in message
    length = len(PromptDataset(_long_rows(), tokenizer, max_prompt_length=4096)[1]["prompt_ids"])
    assert f"prompt is {length} tokens" in message


def test_left_truncation_keeps_the_last_tokens_and_right_truncation_the_first(tokenizer):
    full = PromptDataset(_long_rows(), tokenizer, max_prompt_length=4096)[1]["prompt_ids"]
    left = PromptDataset(_long_rows(), tokenizer, max_prompt_length=64, truncation="left")
    right = PromptDataset(_long_rows(), tokenizer, max_prompt_length=64, truncation="right")
    assert len(full) > 64
    assert left[1]["prompt_ids"] == full[-64:]
    assert right[1]["prompt_ids"] == full[:64]
    assert left[1]["prompt_text"].endswith("<|im_start|>assistant\n")
    assert left.prompt_lengths()[1] == right.prompt_lengths()[1] == 64
    assert left[0]["prompt_ids"] == PromptDataset(_long_rows(), tokenizer, 4096)[0]["prompt_ids"]


def test_filter_overlong_prompts_drops_them_counts_them_and_keeps_original_indices(tokenizer):
    dataset = PromptDataset(_long_rows(), tokenizer, max_prompt_length=64, filter_overlong_prompts=True)
    assert len(dataset) == 2 and dataset.n_filtered == 1
    assert [dataset[i]["index"] for i in range(2)] == [0, 2]
    item = dataset[1]
    assert set(item) == {
        "prompt_ids",
        "prompt_text",
        "data_source",
        "ground_truth",
        "extra_info",
        "messages",
        "index",
    }
    assert item["messages"] == [{"role": "user", "content": "2 + 2?"}] and item["ground_truth"] == "1"
    assert tokenizer.decode(item["prompt_ids"]) == item["prompt_text"]


def test_a_tokenizer_without_a_chat_template_gets_the_message_contents_joined_by_newlines(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    row = _verl_row("question")
    row["prompt"] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 + 1?"},
    ]
    item = PromptDataset([row], plain, max_prompt_length=64)[0]
    assert item["prompt_text"] == "Be brief.\nWhat is 1 + 1?"
    assert item["prompt_ids"] == tokenizer("Be brief.\nWhat is 1 + 1?", add_special_tokens=False)["input_ids"]


# ---- PromptSampler ----


def _take(sampler: PromptSampler, n: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(n)]


def test_sampler_gives_the_same_batches_for_a_seed_and_others_for_another_seed():
    assert _take(PromptSampler(50, 8, seed=1), 10) == _take(PromptSampler(50, 8, seed=1), 10)
    assert _take(PromptSampler(50, 8, seed=1), 10) != _take(PromptSampler(50, 8, seed=2), 10)


def test_sampler_rolls_over_to_the_next_epoch_without_straddling_it():
    sampler = PromptSampler(10, 4, seed=7)
    assert sampler.steps_per_epoch == 2
    epoch0, epoch1 = _take(sampler, 2), _take(sampler, 2)
    assert sampler.epoch == 1
    for epoch, batches in ((0, epoch0), (1, epoch1)):
        order = np.random.default_rng([7, epoch]).permutation(10).tolist()
        assert batches == [order[0:4], order[4:8]]
        assert len(set(batches[0] + batches[1])) == 8
    assert epoch0 != epoch1


def test_sampler_without_drop_last_ends_each_epoch_with_a_short_batch():
    sampler = PromptSampler(10, 4, seed=0, shuffle=False, drop_last=False)
    assert sampler.steps_per_epoch == 3
    assert _take(sampler, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]


def test_sampler_restored_from_its_state_yields_the_same_next_batches():
    original = PromptSampler(23, 5, seed=11)
    _take(original, 3)
    state = json.loads(json.dumps(original.state_dict()))  # as a checkpoint stores it
    expected = _take(original, 4)  # crosses into epoch 1 (4 batches an epoch)
    restored = PromptSampler(23, 5, seed=999)
    restored.load_state_dict(state)
    assert _take(restored, 4) == expected
    assert restored.epoch == original.epoch == 1


def test_sampler_refuses_to_resume_with_a_different_batch_size():
    state = PromptSampler(23, 5, seed=0).state_dict()
    with pytest.raises(DataError, match="data.train_batch_size was 5 when it was saved and is 4 now"):
        PromptSampler(23, 4, seed=0).load_state_dict(state)


def test_sampler_rejects_a_batch_larger_than_the_dataset_naming_train_batch_size():
    with pytest.raises(DataError, match=r"data.train_batch_size=16 is larger than the 10 rows"):
        PromptSampler(10, 16, seed=0)
