"""Reading what the model wrote: the rollout tables a run leaves in its directory.

    rollouts/step_NNNNNN.parquet         one row per sampled response (see step_log.rollout_rows); a
                                         multi-turn run's rows add turns (JSON), num_turns, tool_calls,
                                         tool_failures and episode_error
    rollouts/tokens_step_NNNNNN.parquet  per-token quantities of a few of those responses: `row` (the
                                         row number in the step's table), token_ids, tokens (each
                                         decoded alone), log_prob, ref_log_prob, kl, entropy, advantage
                                         (float lists), clipped and sampled (bool lists; sampled is False
                                         on an episode's tool and environment tokens, and absent from
                                         files written before multi-turn runs)

Everything here is plain Python over those files (no Streamlit): load a step, put the n responses to a
prompt back together as a group with its reward mean and spread, filter, follow one prompt across
steps, read an episode's turns, and render a response's tokens as coloured HTML. A missing or
half-written file is an `InspectError` with a message a user can act on, never a pyarrow traceback.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

_STEP_FILE = re.compile(r"^step_(\d+)\.parquet$")
REQUIRED_COLUMNS = ("group", "prompt", "response", "reward")
TOKEN_FIELDS = ("token_ids", "tokens", "log_prob", "ref_log_prob", "kl", "entropy", "advantage", "clipped")
PART_PREFIX = "reward_"
# finish_reason of an episode (backend.rollout.episodes), in words for the page
FINISH_WORDS = {"stop": "the model ended and the environment said done",
                "length": "token budget ran out (data.max_response_length, counted over every turn)",
                "max_turns": "turn limit reached", "env_error": "environment failed (the episode scored 0)"}
# a tool call's failure kind (backend.envs.tool_calls), in words
FAILURE_WORDS = {"parse_errors": "the call could not be parsed", "unknown_tool": "no tool of that name",
                 "bad_arguments": "the arguments do not fit the tool", "errors": "the tool raised an error",
                 "timeouts": "the tool timed out"}


class InspectError(Exception):
    """A rollout file that is missing, torn or not in the expected shape; the message says which."""


# ---- files ----


def rollouts_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "rollouts"


def step_file(run_dir: str | Path, step: int) -> Path:
    return rollouts_dir(run_dir) / f"step_{step:06d}.parquet"


def tokens_file(run_dir: str | Path, step: int) -> Path:
    return rollouts_dir(run_dir) / f"tokens_step_{step:06d}.parquet"


def rollout_steps(run_dir: str | Path) -> list[int]:
    """Steps that have a rollouts/step_NNNNNN.parquet, ascending. No folder (no step finished yet, or a
    deleted run) is an empty list; temporary files of a write in progress are not listed."""
    try:
        names = [p.name for p in rollouts_dir(run_dir).iterdir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for name in names if (m := _STEP_FILE.match(name)))


def _read_table(path: Path, what: str, **kwargs: Any) -> pa.Table:
    try:
        return pq.read_table(path, **kwargs)
    except FileNotFoundError:
        raise InspectError(f"{what} is missing: {path} (the run was deleted, or the step is not written yet)") \
            from None
    except (pa.ArrowException, OSError) as e:
        raise InspectError(f"{what} could not be read: {path} is torn or not a parquet file "
                           f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def load_step(run_dir: str | Path, step: int) -> list[dict]:
    """The responses of one step, in file order, as dicts of the parquet's columns plus `row` (the
    response's row number in the file, which the token log refers to)."""
    table = _read_table(step_file(run_dir, step), f"rollouts of step {step}")
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise InspectError(f"rollouts of step {step} lack the column(s) {', '.join(missing)}: "
                           f"{step_file(run_dir, step)} was not written by this trainer")
    rows = table.to_pylist()
    for i, r in enumerate(rows):
        r["row"] = i
        r.setdefault("step", step)
    return rows


def reward_parts(rows: Sequence[dict]) -> list[str]:
    """Names of the reward components present (`reward_correct` -> "correct"), sorted."""
    return sorted({k[len(PART_PREFIX):] for r in rows for k in r if k.startswith(PART_PREFIX)})


# ---- episodes (multi-turn runs) ----


def episode_turns(row: dict) -> list[dict] | None:
    """The turns of an episode's row, in order (assistant turns with their tool calls, observations,
    an environment error); None for a single-turn row, and for a `turns` value that is not a JSON
    list of objects (a torn or foreign file must not take the page down)."""
    raw = row.get("turns")
    if raw is None:
        return None
    try:
        turns = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
    except ValueError:
        return None
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return None
    return turns


def is_episode(row: dict) -> bool:
    """The row is a multi-turn episode (it has turns), as opposed to a single response."""
    return row.get("turns") is not None


def has_episodes(rows: Sequence[dict]) -> bool:
    return any(is_episode(r) for r in rows)


def finish_words(reason: Any) -> str:
    """Why an episode ended, in words ("max_turns" -> "turn limit reached"); an unknown reason as it is."""
    return FINISH_WORDS.get(str(reason), str(reason)) if reason is not None else "unknown"


def _count(x: Any) -> int:
    return int(x) if _finite(x) else 0


# ---- groups and filters ----


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _reward_key(r: dict) -> tuple[int, float]:
    """Sort key: highest reward first, responses without a finite reward last."""
    reward = r.get("reward")
    return (0, -float(reward)) if _finite(reward) else (1, 0.0)


def group_rows(rows: Sequence[dict]) -> list[dict]:
    """The n responses to each prompt of a step put back together, in group order. Each group:
    step, group, prompt, data_source, index, ground_truth, n, responses (sorted by reward, best first),
    mean, std (population, as GRPO normalises by), min, max (over finite rewards; None without any) and
    zero_spread (every response got the same reward: GRPO's advantage is zero, no learning signal)."""
    by_group: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        by_group.setdefault((int(r.get("step") or 0), int(r["group"])), []).append(r)
    groups = []
    for (step, group), members in sorted(by_group.items()):
        rewards = [float(r["reward"]) for r in members if _finite(r.get("reward"))]
        mean = sum(rewards) / len(rewards) if rewards else None
        std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)) if rewards else None
        first = members[0]
        groups.append({
            "step": step, "group": group, "prompt": first.get("prompt"), "data_source": first.get("data_source"),
            "index": first.get("index"), "ground_truth": first.get("ground_truth"), "n": len(members),
            "responses": sorted(members, key=_reward_key),
            "mean": mean, "std": std,
            "min": min(rewards) if rewards else None, "max": max(rewards) if rewards else None,
            "zero_spread": bool(rewards) and max(rewards) - min(rewards) <= 1e-12,
        })
    return groups


def filter_rows(rows: Sequence[dict], *, reward_min: float | None = None, reward_max: float | None = None,
                data_sources: Collection[str] | None = None, truncated_only: bool = False,
                zero_spread_only: bool = False, text: str | None = None, tool_error: bool = False,
                max_turns: bool = False, no_tool_call: bool = False) -> list[dict]:
    """The responses that pass every filter given, in their order. Reward bounds are inclusive (a
    response without a finite reward fails any bound); `data_sources` None means all (an empty
    collection matches none); truncated means finish_reason "length"; zero_spread_only keeps the
    responses of groups whose rewards are all equal (judged over all of `rows`); `text` is a
    case-insensitive substring of the prompt or the response. The episode filters keep episodes only
    (a single-turn row has no tool calls to fail or turns to run out of): tool_error those with a
    failed tool call or an environment error, max_turns those the turn limits ended, no_tool_call
    those that never called a tool."""
    zero = None
    if zero_spread_only:
        zero = {(g["step"], g["group"]) for g in group_rows(rows) if g["zero_spread"]}
    needle = text.strip().casefold() if text and text.strip() else None
    sources = None if data_sources is None else set(data_sources)
    out = []
    for r in rows:
        reward = r.get("reward")
        if reward_min is not None and not (_finite(reward) and reward >= reward_min):
            continue
        if reward_max is not None and not (_finite(reward) and reward <= reward_max):
            continue
        if sources is not None and r.get("data_source") not in sources:
            continue
        if truncated_only and r.get("finish_reason") != "length":
            continue
        if zero is not None and (int(r.get("step") or 0), int(r["group"])) not in zero:
            continue
        if needle and needle not in f"{r.get('prompt') or ''}\n{r.get('response') or ''}".casefold():
            continue
        if (tool_error or max_turns or no_tool_call) and not is_episode(r):
            continue
        if tool_error and not (_count(r.get("tool_failures")) > 0 or r.get("episode_error")):
            continue
        if max_turns and r.get("finish_reason") != "max_turns":
            continue
        if no_tool_call and r.get("tool_calls") != 0:
            continue
        out.append(r)
    return out


def filtered_groups(rows: Sequence[dict], **filters: Any) -> list[dict]:
    """Groups (stats over all their responses, as `group_rows`) that have at least one response passing
    `filter_rows(rows, **filters)`; each gets `shown`: those passing responses, best first."""
    kept = {id(r) for r in filter_rows(rows, **filters)}
    out = []
    for g in group_rows(rows):
        shown = [r for r in g["responses"] if id(r) in kept]
        if shown:
            out.append({**g, "shown": shown})
    return out


def step_summary(rows: Sequence[dict]) -> dict[str, Any]:
    """A step's header: counts of responses, groups, zero-spread groups and truncated responses; mean,
    min and max reward (None without any finite reward); the data sources present."""
    groups = group_rows(rows)
    rewards = [float(r["reward"]) for r in rows if _finite(r.get("reward"))]
    return {"responses": len(rows), "groups": len(groups),
            "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "min_reward": min(rewards) if rewards else None, "max_reward": max(rewards) if rewards else None,
            "zero_spread_groups": sum(g["zero_spread"] for g in groups),
            "truncated": sum(r.get("finish_reason") == "length" for r in rows),
            "data_sources": sorted({str(r["data_source"]) for r in rows if r.get("data_source") is not None})}


# ---- one prompt across steps ----


def prompt_history(run_dir: str | Path, index: int) -> list[dict]:
    """Every logged response to dataset row `index`, at every step: dicts of the rollout columns plus
    `row`, ordered by step, then reward (best first). One DuckDB scan over all step files; files that
    cannot be read (a step being written, a torn file) are left out."""
    files = [step_file(run_dir, s) for s in rollout_steps(run_dir)]
    if not files:
        return []
    try:
        return _history_query(files, index)
    except duckdb.Error:
        readable = [f for f in files if _readable(f)]
        if not readable:
            return []
        try:
            return _history_query(readable, index)
        except duckdb.Error as e:
            raise InspectError(f"the rollouts of {Path(run_dir).name} could not be scanned "
                               f"({str(e).splitlines()[0]})") from None


def _history_query(files: list[Path], index: int) -> list[dict]:
    con = duckdb.connect(":memory:")
    try:
        con.execute("SET python_enable_replacements = false")
        cur = con.execute(
            'SELECT * EXCLUDE (file_row_number), file_row_number AS "row" '
            "FROM read_parquet(?, union_by_name = true, file_row_number = true) "
            'WHERE "index" = ? ORDER BY step, reward DESC NULLS LAST, "row"',
            [[str(f) for f in files], int(index)])
        names = [d[0] for d in cur.description]
        return [dict(zip(names, values, strict=True)) for values in cur.fetchall()]
    finally:
        con.close()


def _readable(path: Path) -> bool:
    try:
        pq.read_metadata(path)
        return True
    except (pa.ArrowException, OSError):
        return False


# ---- the token view ----


def logged_rows(run_dir: str | Path, step: int) -> list[int]:
    """Row numbers of the step's responses that have a token record (only a sample is logged:
    trainer.token_log_max); [] when the step has no token file."""
    path = tokens_file(run_dir, step)
    if not path.exists():
        return []
    table = _read_table(path, f"token log of step {step}", columns=["row"])
    return sorted(int(r) for r in table.column("row").to_pylist() if r is not None)


def token_view(run_dir: str | Path, step: int, row: int) -> dict | None:
    """The token record of response `row` of `step`: {"row", "token_ids", "tokens", "log_prob",
    "ref_log_prob", "kl", "entropy", "advantage", "clipped", "sampled"}, each list as long as `tokens`
    (a field the file lacks reads as all None; `sampled` as all True, as every token of a single-turn
    response is the policy's). None when that response was not logged."""
    path = tokens_file(run_dir, step)
    if not path.exists():
        return None
    table = _read_table(path, f"token log of step {step}")
    if "row" not in table.column_names or "tokens" not in table.column_names:
        raise InspectError(f"token log of step {step} lacks the 'row' or 'tokens' column: {path}")
    rows = table.filter(pc.equal(table.column("row"), int(row))).to_pylist()
    if not rows:
        return None
    record = rows[0]
    n = len(record.get("tokens") or [])
    out: dict[str, Any] = {"row": int(row)}
    for name in TOKEN_FIELDS:
        values = list(record.get(name) or [])
        out[name] = (values + [None] * n)[:n]
    out["sampled"] = _policy_flags(record.get("sampled"), n)
    return out


def _policy_flags(sampled: Sequence[bool | None] | None, n: int) -> list[bool]:
    """Per token of n: did the policy sample it. A missing or null flag reads as True (token logs from
    before multi-turn runs have none)."""
    flags = list(sampled or [])
    return [i >= len(flags) or flags[i] is None or bool(flags[i]) for i in range(n)]


def _policy_tokens(values: Sequence[Any], sampled: Sequence[bool | None] | None) -> list[Any]:
    """`values` without the tokens the policy did not sample."""
    return [v for v, mine in zip(values, _policy_flags(sampled, len(values)), strict=True) if mine]


def token_summary(record: dict, quantity: str) -> dict[str, Any]:
    """For the caption under a token view: tokens, how many the policy sampled, and over those only
    (an episode's tool and environment tokens carry no loss): how many have a value of `quantity`, its
    mean, and how many PPO clipped."""
    sampled = record.get("sampled")
    finite = [float(v) for v in _policy_tokens(record.get(quantity) or [], sampled) if _finite(v)]
    tokens = record.get("tokens") or []
    return {"tokens": len(tokens), "sampled": len(_policy_tokens(tokens, sampled)), "with_value": len(finite),
            "mean": sum(finite) / len(finite) if finite else None,
            "clipped": sum(bool(c) for c in _policy_tokens(record.get("clipped") or [], sampled) if c is not None)}


@dataclass(frozen=True)
class TokenQuantity:
    label: str
    diverging: bool  # signed, centred at 0: red (negative) - white - blue (positive)
    help: str


TOKEN_QUANTITIES: dict[str, TokenQuantity] = {
    "advantage": TokenQuantity("Advantage", True,
                               "The advantage the update used for the token: blue was pushed up, red pushed down."),
    "kl": TokenQuantity("KL to reference (k1)", True,
                        "log_prob - ref_log_prob: blue where the policy likes the token more than the reference "
                        "model does. Empty without a reference model."),
    "log_prob": TokenQuantity("Log-prob (policy)", False,
                              "log p(token) under the policy that sampled it, before the update: the darker, the "
                              "less likely (white = probability 1)."),
    "ref_log_prob": TokenQuantity("Log-prob (reference)", False,
                                  "log p(token) under the reference model: the darker, the less likely."),
    "entropy": TokenQuantity("Entropy", False,
                             "Entropy of the policy's next-token distribution at the token: the darker, the less "
                             "sure the model was (white = 0, darkest = the largest in this response)."),
}
_PROB_QUANTITIES = ("log_prob", "ref_log_prob")
_WHITE = (255, 255, 255)
_NEGATIVE = (178, 24, 43)  # red
_POSITIVE = (33, 102, 172)  # blue
_SEQUENTIAL = (84, 39, 143)  # purple
_MISSING = "#e6e6e6"
_NOT_SAMPLED = "#bdbdbd"  # neutral grey: a tool's or the environment's token inside an episode
NOT_SAMPLED_TITLE = "not sampled by the policy (tool or environment output): no loss"
_CLIP_OUTLINE = "outline:2px solid #ff8c00;outline-offset:-2px;"


def _quantity(name: str) -> TokenQuantity:
    if name not in TOKEN_QUANTITIES:
        raise ValueError(f"unknown token quantity {name!r}; known: {', '.join(TOKEN_QUANTITIES)}")
    return TOKEN_QUANTITIES[name]


def token_scale(values: Sequence[float | None], quantity: str) -> float:
    """The value drawn darkest: max |v| for signed quantities, the largest value for entropy; log-probs
    need none (they are drawn as 1 - probability)."""
    finite = [float(v) for v in values if _finite(v)]
    if quantity in _PROB_QUANTITIES:
        return 1.0
    if _quantity(quantity).diverging:
        return max((abs(v) for v in finite), default=0.0) or 1.0
    return max((v for v in finite), default=0.0) or 1.0


def _blend(color: tuple[int, int, int], t: float) -> tuple[int, int, int]:
    t = min(max(t, 0.0), 1.0)
    return tuple(round(w + (c - w) * t) for w, c in zip(_WHITE, color, strict=True))  # type: ignore[return-value]


def token_color(value: float | None, quantity: str, scale: float) -> tuple[int, int, int] | None:
    """The background of a token: None for a missing value; diverging quantities blend white toward
    blue (positive) or red (negative) by |value| / scale; log-probs toward purple by 1 - probability;
    entropy toward purple by value / scale."""
    if not _finite(value):
        return None
    value = float(value)
    if _quantity(quantity).diverging:
        return _blend(_POSITIVE if value >= 0 else _NEGATIVE, abs(value) / scale)
    if quantity in _PROB_QUANTITIES:
        return _blend(_SEQUENTIAL, 1.0 - math.exp(min(value, 0.0)))
    return _blend(_SEQUENTIAL, value / scale)


def _display(token: str) -> str:
    text = html.escape(token, quote=True).replace("\r", "").replace("\t", "⇥").replace("\n", "⏎")
    return text if text else "∅"


def token_html(tokens: Sequence[str], values: Sequence[float | None], quantity: str, *,
               clipped: Sequence[bool | None] | None = None, scale: float | None = None,
               sampled: Sequence[bool | None] | None = None) -> str:
    """The response as one HTML block: a span per token, its background the token's value of `quantity`
    (see `token_color`), a title tooltip with the exact value, clipped tokens outlined in orange. Tokens
    whose `sampled` flag is False (an episode's tool and environment output) are plain grey with a
    tooltip saying so, and do not set the scale. Token text is HTML-escaped; a newline shows as ⏎ and
    breaks the line, a tab as ⇥, an empty token as ∅."""
    spec = _quantity(quantity)
    values = list(values) + [None] * max(0, len(tokens) - len(values))
    policy = _policy_flags(sampled, len(tokens))
    scale = token_scale(_policy_tokens(values, sampled), quantity) if scale is None else (abs(scale) or 1.0)
    clipped = list(clipped or [])
    spans = []
    for i, token in enumerate(tokens):
        value = values[i]
        color = token_color(value, quantity, scale)
        is_clipped = i < len(clipped) and bool(clipped[i])
        shown = f"{float(value):.6g}" if color is not None else "n/a"
        title = f"{spec.label} = {shown} · token {i}" + (" · clipped" if is_clipped else "")
        if not policy[i]:
            title, is_clipped = f"{NOT_SAMPLED_TITLE} · token {i}", False
            style = f"background:{_NOT_SAMPLED};color:#333;"
        elif color is None:
            style = f"background:{_MISSING};color:#555;"
        else:
            dark = (0.299 * color[0] + 0.587 * color[1] + 0.114 * color[2]) < 140
            style = f"background:rgb{color};color:{'#fff' if dark else '#111'};"
        style += "border-radius:2px;padding:1px 0;margin-right:1px;white-space:pre-wrap;"
        if is_clipped:
            style += _CLIP_OUTLINE
        span = f'<span title="{html.escape(title, quote=True)}" style="{style}">{_display(str(token))}</span>'
        spans.append(span + ("<br>" if "\n" in str(token) else ""))
    return ('<div style="font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:0.9rem;'
            f'line-height:1.9;word-break:break-word;">{"".join(spans)}</div>')


def token_legend_html(quantity: str, values: Sequence[float | None], *,
                      sampled: Sequence[bool | None] | None = None) -> str:
    """A colour bar with the scale `token_html` uses for these values (over the sampled tokens), the
    clipped outline, and the grey of tokens the policy did not sample when there are any."""
    spec = _quantity(quantity)
    scale = token_scale(_policy_tokens(values, sampled), quantity)
    if spec.diverging:
        stops = [(-scale, _blend(_NEGATIVE, 1)), (0.0, _WHITE), (scale, _blend(_POSITIVE, 1))]
        ends = (f"{-scale:.3g}", "0", f"+{scale:.3g}")
    elif quantity in _PROB_QUANTITIES:
        stops = [(0, _WHITE), (1, _blend(_SEQUENTIAL, 0.5)), (2, _SEQUENTIAL)]
        ends = ("p = 1 (log-prob 0)", "p = 0.5", "p → 0")
    else:
        stops = [(0, _WHITE), (1, _blend(_SEQUENTIAL, 0.5)), (2, _SEQUENTIAL)]
        ends = ("0", f"{scale / 2:.3g}", f"{scale:.3g}")
    unsampled = ""
    if not all(_policy_flags(sampled, len(sampled or []))):
        unsampled = (f' · <span style="background:{_NOT_SAMPLED};padding:0 4px;">grey</span> '
                     f"{html.escape(NOT_SAMPLED_TITLE)}")
    gradient = ", ".join(f"rgb{c}" for _, c in stops)
    labels = "".join(f"<span>{html.escape(e)}</span>" for e in ends)
    return ('<div style="font-size:0.8rem;max-width:480px;">'
            f'<div style="height:12px;border:1px solid #ccc;background:linear-gradient(to right, {gradient});"></div>'
            f'<div style="display:flex;justify-content:space-between;">{labels}</div>'
            f'<div style="margin-top:4px;"><span style="{_CLIP_OUTLINE}padding:0 4px;">token</span> '
            'outlined: PPO clipped its ratio after the update · '
            f'<span style="background:{_MISSING};padding:0 4px;">n/a</span> no value{unsampled}</div></div>')
