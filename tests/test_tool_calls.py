"""Whatever a model writes as a tool call, the episode gets an answer it can read and the run goes on:
malformed JSON, an unknown tool, wrong arguments, a tool that raises, hangs or floods its output. And the
ways a user names tools and environments fail with messages that say what to do."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from backend.envs.environment import Environment, Step, ToolEnvironment, ToolLimits, load_environment
from backend.envs.tool_calls import argument_problems, parse_calls, run_call, truncate
from backend.envs.tools import Tool, ToolError, get_tool, load_tool_config, register_tool, resolve_tool, resolve_tools


def _call(text: str, tools: dict[str, Tool] | None = None, timeout_s: float = 2.0, max_chars: int = 256):
    tools = tools if tools is not None else {"calculator": get_tool("calculator")}
    (parsed,) = parse_calls(text)
    return run_call(tools, *parsed, timeout_s=timeout_s, max_chars=max_chars)


def test_a_well_formed_calculator_call_answers_with_the_exact_result():
    call = _call('<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 86"}}\n</tool_call>')
    assert (call.output, call.failure, call.arguments) == ("29842", None, {"expression": "347 * 86"})


def test_arguments_written_as_a_json_string_are_accepted():
    call = _call('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1200 + 3456\\"}"}</tool_call>')
    assert call.output == "4656"


def test_malformed_json_is_answered_with_where_it_broke_and_counted_as_a_parse_error():
    call = _call('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"</tool_call>')
    assert call.failure == "parse_errors"
    assert call.output.startswith("Error: the tool call is not valid JSON") and "at character" in call.output


def test_an_unclosed_tool_call_at_the_end_of_a_turn_is_still_read():
    call = _call('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "9 * 9"}}')
    assert call.output == "81"


def test_a_call_that_is_not_an_object_with_a_name_says_what_shape_is_expected():
    call = _call('<tool_call>["calculator", "2+2"]</tool_call>')
    assert call.failure == "parse_errors" and '"name" string' in call.output


def test_an_unknown_tool_is_answered_with_the_list_of_tools():
    call = _call('<tool_call>{"name": "calc", "arguments": {"expression": "1"}}</tool_call>')
    assert call.failure == "unknown_tool"
    assert call.output == "Error: there is no tool named 'calc'; the tools are: calculator"


def test_wrong_argument_names_and_types_are_named():
    call = _call('<tool_call>{"name": "calculator", "arguments": {"expression": 12, "precision": 3}}</tool_call>')
    assert call.failure == "bad_arguments"
    assert "argument 'expression' must be a string, got 12" in call.output
    assert "unknown argument 'precision'" in call.output
    missing = _call('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>')
    assert missing.output == "Error: calculator: missing argument 'expression'"


def test_a_bool_is_not_taken_for_a_number():
    tool = Tool("t", "", {"type": "object", "properties": {"n": {"type": "integer"}}}, lambda n: str(n))
    assert argument_problems(tool, {"n": True}) == ["argument 'n' must be a integer, got true"]
    assert argument_problems(tool, {"n": 3}) == []


def test_a_calculator_error_reaches_the_model_as_text():
    call = _call('<tool_call>{"name": "calculator", "arguments": {"expression": "1 / 0"}}</tool_call>')
    assert call.failure == "errors" and "division by zero" in call.output
    call = _call('<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>')
    assert call.failure == "errors" and "not allowed" in call.output


def test_a_tool_that_hangs_is_answered_with_a_timeout_within_its_limit():
    slow = Tool("slow", "", {"type": "object", "properties": {}}, lambda: time.sleep(60))
    start = time.perf_counter()
    call = _call('<tool_call>{"name": "slow", "arguments": {}}</tool_call>', {"slow": slow}, timeout_s=0.3)
    assert time.perf_counter() - start < 2
    assert call.failure == "timeouts" and call.output == "Error: slow did not answer within 0.3 s"


def test_a_tool_that_returns_a_flood_is_cut_to_the_configured_length():
    flood = Tool("flood", "", {"type": "object", "properties": {}}, lambda: "a" * 10_000_000 + "END")
    call = _call('<tool_call>{"name": "flood", "arguments": {}}</tool_call>', {"flood": flood}, max_chars=100)
    assert call.failure is None and len(call.output) == 100 + len("...(truncated)") and call.output.endswith("END")


def test_truncation_keeps_the_side_asked_for():
    text = "0123456789"
    assert truncate(text, 4, "left") == "0123...(truncated)"
    assert truncate(text, 4, "right") == "...(truncated)6789"
    assert truncate(text, 4, "middle") == "01...(truncated)89"
    assert truncate(text, 10, "middle") == text


def test_calls_past_max_parallel_calls_are_answered_without_running():
    ran = []
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    tool = Tool("note", "", schema, lambda x: ran.append(x) or "ok")
    env = ToolEnvironment([tool], ToolLimits(max_parallel_calls=1))
    step = env.step('<tool_call>{"name": "note", "arguments": {"x": 1}}</tool_call>'
                    '<tool_call>{"name": "note", "arguments": {"x": 2}}</tool_call>')
    assert ran == [1] and [c.output for c in step.tool_calls] == ["ok", "Error: only 1 tool call(s) a turn are run; "
                                                                         "this one was not"]
    assert step.observation == [{"role": "tool", "name": "note", "content": "ok"},
                                {"role": "tool", "name": "note", "content": step.tool_calls[1].output}]


def test_a_turn_without_a_tool_call_ends_the_tool_environment():
    assert ToolEnvironment([get_tool("calculator")]).step("The answer is 42. #### 42") == Step(done=True)


# ---- naming tools and environments ----

def test_register_tool_reads_the_schema_off_the_signature_and_docstring():
    @register_tool()
    def lookup_price(item: str, quantity: int = 1) -> str:
        """Price of an item in the shop.

        Longer notes the model does not need."""
        return f"{item}: {quantity * 3}"

    tool = get_tool("lookup_price")
    assert tool.schema() == {"type": "function", "function": {
        "name": "lookup_price", "description": "Price of an item in the shop.",
        "parameters": {"type": "object", "properties": {"item": {"type": "string"}, "quantity": {"type": "integer"}},
                       "required": ["item"]}}}
    assert tool(item="pen", quantity=2) == "pen: 6"


def test_a_parameter_without_a_json_type_is_refused_at_registration():
    with pytest.raises(ToolError, match="parameter 'when' needs a type hint"):
        @register_tool()
        def bad(when: object) -> str:
            return ""


def test_an_unknown_tool_name_suggests_the_nearest_one():
    with pytest.raises(ToolError, match="Did you mean 'calculator'"):
        resolve_tool("calculater")


def test_a_tool_from_a_users_file_with_config_bound_into_its_calls(tmp_path):
    (tmp_path / "shop.py").write_text("def price(item: str, currency: str = 'EUR') -> str:\n"
                                      "    '''Price of an item.'''\n    return f'3 {currency}'\n")
    tool = resolve_tool(f"{tmp_path / 'shop.py'}:price", {"currency": "USD"})
    assert tool(item="pen") == "3 USD" and tool.parameters["required"] == ["item"]
    with pytest.raises(ToolError, match="takes no argument colour"):
        resolve_tool(f"{tmp_path / 'shop.py'}:price", {"colour": "red"})
    with pytest.raises(ToolError, match="'nothing' is not a function"):
        resolve_tool(f"{tmp_path / 'shop.py'}:nothing")


def test_a_tool_config_file_in_verls_shape_lists_tools_and_bad_entries_are_named(tmp_path):
    good = tmp_path / "tools.yaml"
    good.write_text("tools:\n  - class_name: calculator\n  - class_name: python\n    config: {wall_s: 3}\n"
                    "    tool_schema: {type: function, function: {name: run_code, description: Run code.}}\n")
    tools = load_tool_config(good)
    assert [t.name for t in tools] == ["calculator", "run_code"] and tools[1].config == {"wall_s": 3}
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools:\n  - config: {}\n")
    with pytest.raises(ToolError, match=r"tools\[0\] needs a class_name"):
        load_tool_config(bad)
    with pytest.raises(ToolError, match="file not found"):
        load_tool_config(tmp_path / "missing.yaml")
    with pytest.raises(ToolError, match="two tools are named 'calculator'"):
        resolve_tools(["calculator"], str(good))


def test_environments_are_loaded_by_name_or_file_and_bad_ones_say_why(tmp_path):
    assert load_environment("tools") is ToolEnvironment
    (tmp_path / "games.py").write_text(
        "from backend import Environment, Step, register_environment\n"
        "@register_environment('guess')\n"
        "class Guess(Environment):\n"
        "    def step(self, assistant_text):\n"
        "        return Step(reward={'solved': 1.0}, done=True)\n"
        "class NoStep(Environment):\n    pass\n"
        "class NotOne:\n    pass\n")
    cls = load_environment(f"{tmp_path / 'games.py'}:Guess")
    assert issubclass(cls, Environment) and load_environment("guess") is cls
    with pytest.raises(ToolError, match="does not define step"):
        load_environment(f"{tmp_path / 'games.py'}:NoStep")
    with pytest.raises(ToolError, match="not a subclass of backend.Environment"):
        load_environment(f"{tmp_path / 'games.py'}:NotOne")
    with pytest.raises(ToolError, match="environments found there: Guess, NoStep"):
        load_environment(f"{tmp_path / 'games.py'}:Missing")
    with pytest.raises(ToolError, match="Did you mean 'guess'"):
        load_environment("gues")


def test_the_guessing_game_example_makes_its_data_passes_the_pre_run_checks_and_plays(tmp_path, monkeypatch):
    import runpy

    from backend.core.config import load_config
    from backend.core.data import load_rows, row_item
    from backend.engine.checks import preflight

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    monkeypatch.setattr("sys.argv", ["make_data.py", str(tmp_path)])
    runpy.run_path(str(root / "examples/guess_number/make_data.py"), run_name="__main__")
    cfg = load_config(root / "examples/guess_number/config.yaml", [
        f"data.train_files=[{tmp_path / 'guess_train.parquet'}]", f"data.val_files=[{tmp_path / 'guess_val.parquet'}]",
        "actor_rollout_ref.model.path=tiny-qwen3"])
    assert preflight(cfg) == []
    env = load_environment(cfg.actor_rollout_ref.rollout.multi_turn.environment)()
    row = row_item(load_rows(tmp_path / "guess_train.parquet")[0])
    target = int(row["ground_truth"])
    assert env.reset(row) == row["messages"]
    assert env.step("Is it 0?").observation == [{"role": "user", "content": "Higher."}]
    assert env.step(f"It is {target}.") == Step(reward={"solved": 0.9}, done=True)


def test_the_pre_run_checks_count_the_tools_prompt_tokens_against_the_models_context():
    from backend.core.config import load_config
    from backend.engine.checks import preflight

    def context_problems(prompt: int) -> list[str]:
        cfg = load_config(None, ["actor_rollout_ref.model.path=tiny-qwen3", f"data.max_prompt_length={prompt}",
                                 "data.max_response_length=200", "actor_rollout_ref.rollout.multi_turn.enable=true",
                                 "actor_rollout_ref.rollout.multi_turn.tools=[calculator]"])
        return [p for p in preflight(cfg) if "model's context" in p]

    # tiny-qwen3 has 1024 positions: 600 + 200 fit alone, not with the calculator offered in the prompt.
    (problem,) = context_problems(600)
    assert "data.max_prompt_length + the tools' " in problem and "1024 positions" in problem
    assert context_problems(300) == []
