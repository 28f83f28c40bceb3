"""Where an episode batch's generation time goes, on the engine alone (no trainer, no Ray): the workbench engine
generating one turn of R tokens for each row, against the same engine playing episodes of `--turns` turns
with a fixed user message between them (the multi-turn benchmark's workload, bench/multi_turn_step.py), each
timed over `--repeats` calls after a warm-up, with Python's profiler over one call of each.

    python bench/episode_generation.py --tokenizer .tok --turns 4                                   # GPU machine
    python bench/episode_generation.py --tokenizer ../shared/models/smollm2-tokenizer --small --turns 2   # CPU check

Prints the times and the functions that took the most time in each, and writes bench/results/<date>-<device>-
episode-generation.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import engine_step  # noqa: E402
import grpo_step  # noqa: E402
import trl_grpo  # noqa: E402
from bench_environment import REPLY, FixedReply  # noqa: E402

from backend.core.models import load_model, load_tokenizer  # noqa: E402
from backend.rollout.base import SamplingParams  # noqa: E402
from backend.rollout.episodes import ChatRenderer, TurnLimits, play_episodes  # noqa: E402
from backend.rollout.static_cache import StaticCacheEngine  # noqa: E402


def timed(fn, repeats: int) -> tuple[list[float], str]:
    """Seconds of each of `repeats` calls of fn after one warm-up, and the profile of one more call."""
    fn()
    seconds = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    profile = cProfile.Profile()
    profile.runcall(lambda: (fn(), sync()))
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
    return seconds, text.getvalue()


def clocked_phases(engine: StaticCacheEngine, call) -> dict[str, float]:
    """Seconds of one call of `call` spent starting turns (prompt prefills and appended observations: the
    engine's _begin), in decode steps, waiting on environments (what play returns), and in the rest
    (the host's turn ends: decoding text, handing steps to threads, bookkeeping)."""
    spent = {"turn starts (prefill, append)": 0.0, "decode steps": 0.0}
    calls = {"turn starts (prefill, append)": 0, "decode steps": 0}

    def clocked(name: str, fn):
        def run(*a, **k):
            sync()
            start = time.perf_counter()
            out = fn(*a, **k)
            sync()
            spent[name] += time.perf_counter() - start
            calls[name] += 1
            return out
        return run

    begin, step, play = engine._begin, engine._step, engine.play
    waited = []
    engine._begin = clocked("turn starts (prefill, append)", begin)
    engine._step = clocked("decode steps", step)
    engine.play = lambda *a, **k: waited.append(play(*a, **k)) or waited[-1]
    sync()
    start = time.perf_counter()
    call()
    sync()
    total = time.perf_counter() - start
    engine._begin, engine._step, engine.play = begin, step, play
    spent["waiting on environments"] = waited[-1]
    spent["the rest (host)"] = total - sum(spent.values())
    spent["total"] = total
    return {**{k: round(v, 3) for k, v in spent.items()}, **{f"{k}: calls": v for k, v in calls.items()}}


def traced_turn_starts(engine: StaticCacheEngine, call) -> str:
    """torch.profiler's table of one call of `call`, with the engine's turn starts labelled: which operations
    the prompts' prefill and the appended observations spend their time in."""
    begin = engine._begin

    def labelled(*a, **k):
        with torch.profiler.record_function("turn start"):
            return begin(*a, **k)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    engine._begin = labelled
    try:
        with torch.profiler.profile(activities=activities) as prof:
            call()
            sync()
    finally:
        engine._begin = begin
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=30)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="tokenizer folder (with a chat template)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small", action="store_true", help="a 2-layer model and 16 rows x 32 tokens: checks the script")
    p.add_argument("--out", default=None)
    p.add_argument("--trace", action="store_true", help="also print torch.profiler's table of one episodes call")
    args = p.parse_args()

    rows_n, response = (16, 32) if args.small else (512, 256)
    work = Path(tempfile.mkdtemp(prefix="episode-generation-"))
    model_dir = grpo_step.build_model(args.tokenizer, work / "model", args.small, chat_template=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(str(model_dir), device, dtype).eval()
    tokenizer = load_tokenizer(str(model_dir))
    renderer = ChatRenderer(tokenizer, [], [tokenizer.eos_token_id])
    observation = len(renderer.observation(REPLY))
    per_turn = (response - (args.turns - 1) * observation) // args.turns
    total = args.turns * per_turn + (args.turns - 1) * observation
    rows = [{"messages": [{"role": "user", "content": text}]} for text in trl_grpo.random_prompts(rows_n)]
    prompts = [renderer.prompt(r["messages"])[0] for r in rows]
    engine = StaticCacheEngine(model, tokenizer, rows_n, device, dtype, max_len=max(map(len, prompts)) + total,
                               free_after_generate=False)
    engine.load_weights(model)
    params = SamplingParams(n=1, max_new_tokens=total, ignore_eos=True, seed=1)
    limits = TurnLimits(total, args.turns, args.turns - 1, 60.0, max_tokens_per_turn=per_turn)

    single, single_profile = timed(lambda: engine.generate(prompts, params), args.repeats)
    episodes, episodes_profile = timed(lambda: play_episodes(engine, tokenizer, renderer,
                                                             [FixedReply() for _ in rows], rows, params, limits),
                                       args.repeats)
    phases = clocked_phases(engine, lambda: play_episodes(engine, tokenizer, renderer, [FixedReply() for _ in rows],
                                                          rows, params, limits))
    if args.trace:
        print(traced_turn_starts(engine, lambda: play_episodes(engine, tokenizer, renderer,
                                                               [FixedReply() for _ in rows], rows, params, limits)))
    result = {"rows": rows_n, "turns": args.turns, "tokens_per_turn": per_turn, "observation_tokens": observation,
              "tokens_after_prompt": total, "single_turn_s": single, "episodes_s": episodes,
              "single_turn_median_s": statistics.median(single), "episodes_median_s": statistics.median(episodes)}
    result["overhead"] = round(result["episodes_median_s"] / result["single_turn_median_s"] - 1, 3)
    result["episodes_phases_s"] = phases
    print(single_profile)
    print(episodes_profile)
    print("one episode call, each phase synchronised (so a little slower in all):")
    for name, value in phases.items():
        print(f"  {name:<48} {value:8}")
    print(f"{rows_n} rows, {total} tokens after the prompt: one turn {result['single_turn_median_s']:.3f} s, "
          f"{args.turns} turns of {per_turn} with {observation}-token messages {result['episodes_median_s']:.3f} s "
          f"({100 * result['overhead']:+.1f}%)")
    name = torch.cuda.get_device_name().replace(" ", "-").lower() if device.type == "cuda" else "cpu"
    default = BENCH / "results" / f"{time.strftime('%Y-%m-%d')}-{name}-episode-generation.json"
    out = Path(args.out) if args.out else default
    engine_step.append_record(out, result)


if __name__ == "__main__":
    main()
