"""The supervised warm-start: demonstrations laid out token for token as the run's episodes, loss on the
assistant's tokens only, an ordinary run directory, and a model that then writes the tool call."""

from __future__ import annotations

import pytest
import torch

from backend.core import data
from backend.core.config import ConfigError, load_config
from backend.core.models import load_model, load_tokenizer
from backend.core.runs import read_metrics, read_status
from backend.engine.sft import IGNORE, conversation_tokens, train_sft
from backend.envs.tool_calls import parse_calls
from backend.envs.tools import get_tool
from backend.rollout.base import HFGenerateEngine, SamplingParams
from backend.rollout.episodes import ChatRenderer


@pytest.fixture(scope="module")
def calculator_sets(tmp_path_factory):
    return data.write_calculator_sets(tmp_path_factory.mktemp("calculator"), n_train=64, n_val=16, n_demos=64)


def test_calculator_sets_hold_hard_problems_disjoint_splits_and_worked_demonstrations(calculator_sets):
    train, val = data.load_rows(calculator_sets["train"]), data.load_rows(calculator_sets["val"])
    expressions = [r["extra_info"]["expression"] for r in train]
    assert not {r["extra_info"]["expression"] for r in val} & set(expressions)
    for row in train:
        a, op, b = row["extra_info"]["expression"].split()
        assert (op, len(a), len(b)) in (("*", 3, 2), ("+", 4, 4))
        assert int(row["reward_model"]["ground_truth"]) == (int(a) * int(b) if op == "*" else int(a) + int(b))
    conversation = data.load_messages(calculator_sets["demos"])[0]
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool", "assistant"]
    (name, arguments, problem), = parse_calls(conversation[1]["content"])
    from backend.envs.calculator import calculate
    assert problem is None and calculate(arguments["expression"]) == conversation[2]["content"]
    assert conversation[3]["content"].endswith(f"#### {conversation[2]['content']}")


def test_a_demonstration_is_laid_out_as_an_episode_with_loss_on_the_assistants_tokens_only(tiny_tokenizer):
    renderer = ChatRenderer(tiny_tokenizer, [get_tool("calculator")], [tiny_tokenizer.eos_token_id])
    messages = [{"role": "user", "content": "What is 12 * 3?"},
                {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": '
                                                 '"12 * 3"}}</tool_call>'},
                {"role": "tool", "name": "calculator", "content": "36"},
                {"role": "assistant", "content": "#### 36"}]
    ids, labels = conversation_tokens(messages, tiny_tokenizer, renderer, 4096)
    prompt, _ = renderer.prompt(messages[:1])
    eos = tiny_tokenizer.eos_token_id

    def encode(text):
        return tiny_tokenizer(text, add_special_tokens=False)["input_ids"]

    call, answer = encode(messages[1]["content"]) + [eos], encode("#### 36") + [eos]
    observation = renderer.observation(messages[2:3])
    assert ids == prompt + call + observation + answer
    assert labels == [IGNORE] * len(prompt) + call + [IGNORE] * len(observation) + answer
    with pytest.raises(data.DataError, match="must start with at least one prompt message"):
        conversation_tokens(messages[1:], tiny_tokenizer, renderer, 4096)


def test_a_messages_file_without_the_column_or_with_a_bad_message_names_the_row(tmp_path):
    data.write_rows(data.make_arithmetic_rows(2, 0, "train"), tmp_path / "rows.parquet")
    with pytest.raises(data.DataError, match="no 'messages' column"):
        data.load_messages(tmp_path / "rows.parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "hi"}], [{"role": "user"}]]}),
                   tmp_path / "bad.parquet")
    with pytest.raises(data.DataError, match="row 1: every message needs a role and a string content"):
        data.load_messages(tmp_path / "bad.parquet")


def test_the_warm_start_writes_a_run_directory_lowers_its_loss_and_teaches_the_call(tmp_path, calculator_sets):
    cfg = load_config(None, ["actor_rollout_ref.model.path=tiny-qwen3", "trainer.device=cpu",
                             "actor_rollout_ref.rollout.multi_turn.tools=[calculator]",
                             f"sft.train_files=[{calculator_sets['demos']}]", "sft.steps=80", "sft.lr=3e-3",
                             "sft.batch_size=8"])
    export = train_sft(cfg, tmp_path / "sft", show_progress=False)
    assert read_status(tmp_path / "sft")["state"] == "succeeded"
    metrics = read_metrics(tmp_path / "sft")
    assert [m["step"] for m in metrics] == list(range(1, 81))
    assert metrics[-1]["sft/loss"] < 0.25 * metrics[0]["sft/loss"]
    assert (tmp_path / "sft" / "config.yaml").is_file() and (export / "config.json").is_file()

    tokenizer = load_tokenizer(str(export))
    renderer = ChatRenderer(tokenizer, [get_tool("calculator")], [tokenizer.eos_token_id])
    row = data.load_rows(calculator_sets["val"])[0]
    prompt, _ = renderer.prompt(row["prompt"])
    out = HFGenerateEngine(load_model(str(export), torch.device("cpu")), tokenizer).generate(
        [prompt], SamplingParams(n=1, greedy=True, max_new_tokens=120))
    text = tokenizer.decode(out.responses[0][out.response_mask[0].bool()], skip_special_tokens=True)
    assert text.startswith('<tool_call>\n{"name": "calculator", "arguments": {"expression": "'), text


def test_a_warm_start_without_data_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match="sft.train_files is empty"):
        train_sft(load_config(None, []), tmp_path / "sft", show_progress=False)
    assert not (tmp_path / "sft").exists()
