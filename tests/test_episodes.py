"""Multi-turn episodes on a real tiny model and the real engine: the trajectory is the engine's sampled ids
and the chat template's observation ids, id for id; observation tokens carry mask 0; budgets and turn
limits end episodes as truncated; a failing environment ends only its own episode."""

from __future__ import annotations

import pytest
import torch

from backend.core.models import load_model, load_tokenizer
from backend.envs.environment import Environment, Step, ToolEnvironment, ToolLimits
from backend.envs.tools import get_tool
from backend.rollout.base import HFGenerateEngine, SamplingParams
from backend.rollout.episodes import (
    ENV_ERROR,
    LENGTH,
    MAX_TURNS,
    STOP,
    ChatRenderer,
    TurnLimits,
    episode_batch,
    episode_metrics,
    play_episodes,
    run_episodes,
)

from .conftest import CALL_TEXT


@pytest.fixture(scope="module")
def engine(tool_model):
    tokenizer = load_tokenizer(str(tool_model))
    return HFGenerateEngine(load_model(str(tool_model), torch.device("cpu")), tokenizer)


def _calculator_env() -> ToolEnvironment:
    return ToolEnvironment([get_tool("calculator")])


def _rows(questions: list[str]) -> list[dict]:
    return [{"messages": [{"role": "user", "content": q}], "ground_truth": "36", "data_source": "arithmetic",
             "extra_info": {}} for q in questions]


class Recording:
    """The engine's generate, keeping what each call returned (the ids the engine sampled)."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = []

    def __call__(self, prompts, params, row_ids):
        out = self.engine.generate(prompts, params, row_ids=row_ids)
        self.calls.append((prompts, out))
        return out


def _run(engine, envs, rows, max_response_length=400, max_assistant_turns=3, max_user_turns=5, greedy=True,
         tokenizer=None):
    tokenizer = tokenizer or engine.tokenizer
    renderer = ChatRenderer(tokenizer, [get_tool("calculator")], [tokenizer.eos_token_id])
    recording = Recording(engine)
    episodes = run_episodes(recording, tokenizer, renderer, envs, rows,
                            SamplingParams(n=1, greedy=greedy, max_new_tokens=max_response_length),
                            TurnLimits(max_response_length, max_assistant_turns, max_user_turns, 5.0))
    return episodes, renderer, recording


def test_a_three_turn_episode_is_the_engines_sampled_ids_and_the_templates_observation_ids_id_for_id(engine):
    tokenizer = engine.tokenizer
    episodes, renderer, recording = _run(engine, [_calculator_env()], _rows(["What is 55 + 1?"]))
    (e,) = episodes
    assert e.assistant_turns == 3 and e.observation_turns == 2 and e.finish_reason == MAX_TURNS

    # Each turn's prompt was the whole prefix so far, and the episode appended exactly what came back.
    expected = list(e.prompt_ids)
    for k, (prompts, out) in enumerate(recording.calls):
        assert prompts == [expected]
        sampled = out.responses[0, :int(out.response_mask[0].sum())].tolist()
        assert sampled[-1] == tokenizer.eos_token_id
        expected += sampled
        if k < 2:
            observation = renderer.observation([{"role": "tool", "name": "calculator", "content": "36"}])
            expected += observation
    assert e.prompt_ids + e.ids == expected

    # The batch the trainer scores holds those ids, and the whole conversation rendered by the template
    # from text gives the same ids (the trajectory was never decoded and re-encoded, and did not need to be).
    batch = episode_batch(episodes, torch.tensor([0]), tokenizer.pad_token_id, with_log_probs=False)
    row = batch.input_ids[0][batch.attention_mask[0].bool()].tolist()
    assert row == expected
    conversation = renderer.with_tools([{"role": "user", "content": "What is 55 + 1?"}])
    for k in range(3):
        conversation.append({"role": "assistant", "content": CALL_TEXT})
        if k < 2:
            conversation.append({"role": "tool", "name": "calculator", "content": "36"})
    rendered = tokenizer(tokenizer.apply_chat_template(conversation, tokenize=False),
                         add_special_tokens=False)["input_ids"]
    assert rendered[:len(row)] == row

    # Mask 1 on the sampled tokens only: two runs of observation tokens inside the response are 0.
    mask = batch.response_mask[0].tolist()
    call_len = len(tokenizer(CALL_TEXT, add_special_tokens=False)["input_ids"]) + 1
    obs_len = len(renderer.observation([{"role": "tool", "name": "calculator", "content": "36"}]))
    assert mask == [1] * call_len + [0] * obs_len + [1] * call_len + [0] * obs_len + [1] * call_len
    assert e.turns[1] == {"role": "tool", "name": "calculator", "text": "36"}
    assert e.turns[0]["tool_calls"][0]["arguments"] == {"expression": "12 * 3"}


def test_the_response_budget_counts_every_turn_and_ends_the_episode_as_truncated(engine):
    call_len = len(engine.tokenizer(CALL_TEXT, add_special_tokens=False)["input_ids"]) + 1
    budget = call_len + 5  # room for the first call and five tokens of its observation
    (e,), _, _ = _run(engine, [_calculator_env()], _rows(["What is 55 + 1?"]), budget)
    assert e.finish_reason == LENGTH
    assert len(e.ids) == budget and e.mask == [1] * call_len + [0] * 5
    assert episode_metrics([e])["multi_turn/truncated_by_budget"] == 1.0


def test_max_user_turns_ends_an_episode_that_would_go_on(engine):
    (e,), _, _ = _run(engine, [_calculator_env()], _rows(["What is 55 + 1?"]), max_assistant_turns=5,
                      max_user_turns=1)
    assert (e.assistant_turns, e.observation_turns, e.finish_reason) == (2, 1, MAX_TURNS)
    assert episode_metrics([e])["multi_turn/truncated_by_turns"] == 1.0


class Failing(Environment):
    def step(self, assistant_text):
        raise RuntimeError("the environment broke")


class Done(Environment):
    def step(self, assistant_text):
        return Step(reward={"solved": 1.0, "bonus": 0.5}, done=True)


def test_an_environment_that_raises_ends_its_own_episode_and_the_others_go_on(engine):
    envs = [Failing(), Done(), _calculator_env()]
    episodes, _, _ = _run(engine, envs, _rows(["What is 8 + 1?", "What is 30 + 4?", "What is 55 + 1?"]))
    failed, done, tools = episodes
    assert failed.finish_reason == ENV_ERROR and "RuntimeError: the environment broke" in failed.error
    assert done.finish_reason == STOP and done.reward == {"solved": 1.0, "bonus": 0.5}
    assert tools.finish_reason == MAX_TURNS and tools.error is None
    m = episode_metrics(episodes)
    assert m["multi_turn/env_errors"] == 1.0 and m["tool/calculator/calls"] == 3.0 and m["tool/success_rate"] == 1.0


def test_a_first_prompt_over_max_prompt_length_plus_the_tools_ends_its_own_episode(engine):
    tokenizer = engine.tokenizer
    renderer = ChatRenderer(tokenizer, [get_tool("calculator")], [tokenizer.eos_token_id])
    plain = ChatRenderer(tokenizer, [], [tokenizer.eos_token_id])
    short, long = _rows(["What is 8 + 1?", "What is 8 + 1? " + "Think hard. " * 40])
    assert renderer.tools_tokens == len(renderer.prompt(short["messages"])[0]) - len(plain.prompt(short["messages"])[0])
    limit = len(plain.prompt(short["messages"])[0]) + 5
    first, second = run_episodes(engine.generate, tokenizer, renderer, [_calculator_env(), _calculator_env()],
                                 [long, short], SamplingParams(n=1, greedy=True, max_new_tokens=200),
                                 TurnLimits(200, 1, 1, 5.0, max_prompt_length=limit + renderer.tools_tokens))
    assert first.finish_reason == ENV_ERROR and first.assistant_turns == 0
    assert f"over data.max_prompt_length={limit} plus the tools'" in first.error
    assert second.assistant_turns == 1 and second.error is None


class Hanging(Environment):
    def step(self, assistant_text):
        import time
        time.sleep(30)


def test_an_environment_step_that_hangs_is_abandoned_after_its_timeout(engine):
    renderer = ChatRenderer(engine.tokenizer, [], [engine.tokenizer.eos_token_id])
    (e,) = run_episodes(engine.generate, engine.tokenizer, renderer, [Hanging()], _rows(["What is 55 + 1?"]),
                        SamplingParams(n=1, greedy=True, max_new_tokens=200), TurnLimits(200, 3, 3, 0.5))
    assert e.finish_reason == ENV_ERROR and "did not return within 0.5 s" in e.error


def test_a_tool_call_answered_with_an_error_is_shown_to_the_model_and_counted(engine):
    def broken(expression: str) -> str:
        raise ZeroDivisionError("no")

    from backend.envs.tools import Tool
    tool = Tool("calculator", "broken", get_tool("calculator").parameters, broken)
    (e,), _, _ = _run(engine, [ToolEnvironment([tool], ToolLimits(timeout_s=5))], _rows(["What is 55 + 1?"]),
                      max_assistant_turns=2)
    assert e.turns[1]["text"] == "Error: ZeroDivisionError: no"
    assert e.turns[0]["tool_calls"][0]["failure"] == "errors"
    m = episode_metrics([e])
    assert m["tool/errors"] >= 1.0 and m["tool/success_rate"] == 0.0


def test_the_workbench_engine_plays_the_same_episodes_as_hugging_face_generate(engine):
    from backend.rollout.static_cache import StaticCacheEngine

    workbench = StaticCacheEngine(engine.model, engine.tokenizer, batch_size=8, device=torch.device("cpu"),
                                  dtype=torch.float32, max_len=1024, cuda_graphs=False, free_after_generate=False)
    workbench.load_weights(engine.model)
    rows = _rows(["What is 55 + 1?", "What is 8 + 1?"])
    hf, _, _ = _run(engine, [_calculator_env(), _calculator_env()], rows, greedy=False)
    ours, _, _ = _run(workbench, [_calculator_env(), _calculator_env()], rows, greedy=False, tokenizer=engine.tokenizer)
    assert [e.ids for e in ours] == [e.ids for e in hf] and [e.mask for e in ours] == [e.mask for e in hf]
    assert sum(e.observation_turns for e in ours) >= 1


class Replies(Environment):
    def step(self, assistant_text):
        return Step(observation=[{"role": "user", "content": "Go on."}])


def test_max_tokens_per_turn_cuts_a_turn_and_with_ignore_eos_every_turn_runs_to_it(engine):
    tokenizer = engine.tokenizer
    renderer = ChatRenderer(tokenizer, [], [tokenizer.eos_token_id])
    limits = TurnLimits(400, 3, 5, 5.0, max_tokens_per_turn=10)
    (cut,) = run_episodes(engine.generate, tokenizer, renderer, [Replies()], _rows(["What is 55 + 1?"]),
                          SamplingParams(n=1, greedy=True, max_new_tokens=400), limits)
    assert (cut.assistant_turns, len(cut.ids), cut.finish_reason) == (1, 10, LENGTH)
    (fixed,) = run_episodes(engine.generate, tokenizer, renderer, [Replies()], _rows(["What is 55 + 1?"]),
                            SamplingParams(n=1, greedy=True, max_new_tokens=400, ignore_eos=True), limits)
    reply = len(renderer.observation([{"role": "user", "content": "Go on."}]))
    assert (fixed.assistant_turns, fixed.finish_reason) == (3, MAX_TURNS)
    assert fixed.mask == [1] * 10 + [0] * reply + [1] * 10 + [0] * reply + [1] * 10


def _workbench(engine, batch_size: int):
    from backend.rollout.static_cache import StaticCacheEngine

    workbench = StaticCacheEngine(engine.model, engine.tokenizer, batch_size=batch_size, device=torch.device("cpu"),
                                  dtype=torch.float32, max_len=64, cuda_graphs=False, free_after_generate=False)
    workbench.load_weights(engine.model)
    return workbench


def test_episodes_kept_in_the_workbench_engines_cache_are_the_lockstep_episodes_token_for_token(engine):
    # Two cache rows for five episodes that end after one, two or three turns: rows are at different turns
    # at once, a finished episode's row takes a waiting one, and every next turn is appended to its row's
    # cache. Sampled at temperature 1, any difference in the logits would show as a different token.
    tokenizer = engine.tokenizer
    renderer = ChatRenderer(tokenizer, [get_tool("calculator")], [tokenizer.eos_token_id])
    envs = lambda: [_calculator_env(), Done(), _calculator_env(), Replies(), Done()]  # noqa: E731
    rows = _rows(["What is 55 + 1?", "What is 8 + 1?", "What is 30 + 4?", "What is 2 + 2?", "What is 7 + 7?"])
    params = SamplingParams(n=1, max_new_tokens=400, seed=3)
    limits = TurnLimits(400, 3, 5, 5.0)
    lockstep = run_episodes(engine.generate, tokenizer, renderer, envs(), rows, params, limits, first_row=4)
    timings = {}
    kept = play_episodes(_workbench(engine, 2), tokenizer, renderer, envs(), rows, params, limits, first_row=4,
                         timings=timings)
    assert [e.ids for e in kept] == [e.ids for e in lockstep]
    assert [e.mask for e in kept] == [e.mask for e in lockstep]
    assert [e.finish_reason for e in kept] == [e.finish_reason for e in lockstep]
    assert sorted({e.assistant_turns for e in kept}) == [1, 3]
    assert timings["timing_s/tools"] >= 0.0


def test_a_turn_cut_by_max_tokens_per_turn_goes_on_in_the_cache_as_in_lockstep(engine):
    tokenizer = engine.tokenizer
    renderer = ChatRenderer(tokenizer, [], [tokenizer.eos_token_id])
    limits = TurnLimits(200, 4, 5, 5.0, max_tokens_per_turn=9)
    params = SamplingParams(n=1, max_new_tokens=200, ignore_eos=True, seed=1)
    rows = _rows(["What is 55 + 1?", "What is 8 + 1?", "What is 3 + 1?"])
    lockstep = run_episodes(engine.generate, tokenizer, renderer, [Replies() for _ in rows], rows, params, limits)
    kept = play_episodes(_workbench(engine, 3), tokenizer, renderer, [Replies() for _ in rows], rows, params, limits)
    assert [e.ids for e in kept] == [e.ids for e in lockstep]
    assert [(e.assistant_turns, e.finish_reason) for e in kept] == [(4, MAX_TURNS)] * 3
