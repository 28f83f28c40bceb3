"""Comparing two models: answers streamed side by side, scored comparisons on a data file, and saved
evaluations of a run's checkpoints.

Models stay loaded in a small cache keyed by their resolved folder (and its config.json's time stamp,
so a rewritten folder loads again): the compare page reruns on every click and must not reload them.
A checkpoint without a tokenizer gets its run's base tokenizer (models.load_tokenizer finds it).

The statistics are small pure functions with hand-worked tests:
- `pass_at_k(n, c, k)`: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
  Trained on Code"), 1 - C(n-c, k) / C(n, k);
- `majority_vote(answers)`: the most frequent extracted answer, ties broken by first occurrence;
- `paired_difference_ci(a, b)`: mean of d_i = b_i - a_i with a 95% normal-approximation interval
  mean ± 1.96 · sd(d) / sqrt(n) (sd with n - 1). Both models answer the same questions, so the paired
  interval is much narrower than one built from two independent accuracies.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from backend.core import data
from backend.core.models import amp_context, is_model_folder, load_model, load_tokenizer, pick_device, resolve_model
from backend.core.runs import checkpoint_step, config_get, list_checkpoints, read_run_config
from backend.engine.evaluation import is_correct
from backend.engine.inference import Generator, chat_prompt_ids
from backend.rewards.registry import load_custom_reward
from backend.rewards.scoring import score_batch
from backend.rollout.base import HFGenerateEngine, SamplingParams

MAX_CACHED_MODELS = 3
Progress = Callable[[str, int, int], None]  # (what, done, total)


# ---- pure statistics ----

def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c of them correct)
    is correct: 1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i) for stability
    (Chen et al. 2021). With k = n it is 1 when any sample is correct, else 0."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def majority_vote(answers: Sequence[str | None]) -> int | None:
    """Index of the sample whose answer wins the vote: the most frequent answer (None, no answer
    extracted, does not vote), ties broken by the answer seen first. None when nothing voted."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(i for i, a in enumerate(answers) if a is not None and counts[a] == best)


def paired_difference_ci(a: Sequence[float], b: Sequence[float], z: float = 1.96) -> tuple[float, float, float]:
    """(mean, low, high) of the paired difference d_i = b_i - a_i: mean(d) ± z · sd(d) / sqrt(n), sd with
    n - 1 (normal approximation; z = 1.96 for 95%). Fewer than two pairs: low and high are NaN."""
    if len(a) != len(b):
        raise ValueError(f"paired data needs equal lengths, got {len(a)} and {len(b)}")
    if not a:
        raise ValueError("paired_difference_ci needs at least one pair")
    d = [float(y) - float(x) for x, y in zip(a, b, strict=True)]
    mean = sum(d) / len(d)
    if len(d) < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    half = z * sd / math.sqrt(len(d))
    return mean, mean - half, mean + half


def blank_answer(text: str) -> str | None:
    """What an answer that shows nothing is made of, in words ("empty", "12 newlines", "12 newlines and 3
    spaces"), or None when it has something visible. A box with such an answer looks empty: the page says why."""
    if text.strip():
        return None
    if not text:
        return "empty"
    named = {"\n": "newline", " ": "space", "\t": "tab", "\r": "carriage return"}
    counts = Counter(named.get(c, "other blank character") for c in text)
    parts = [f"{n} {what}{'s' if n > 1 else ''}" for what, n in counts.most_common()]
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


# ---- loaded models ----

@dataclass
class _Loaded:
    generator: Generator
    lock: threading.Lock = field(default_factory=threading.Lock)  # one generation at a time per model


_cache: OrderedDict[tuple[str, int], _Loaded] = OrderedDict()
_cache_lock = threading.Lock()


def _cache_key(model: str) -> tuple[str, int]:
    resolved = resolve_model(str(model))
    config = Path(resolved) / "config.json"
    stamp = config.stat().st_mtime_ns if config.is_file() else 0
    return resolved, stamp


def _loaded(model: str, device: str = "auto") -> _Loaded:
    key = _cache_key(model)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
        tokenizer = load_tokenizer(key[0])
        generator = Generator(HFGenerateEngine(load_model(key[0], pick_device(device)).eval(), tokenizer), tokenizer)
        _cache[key] = _Loaded(generator)
        while len(_cache) > MAX_CACHED_MODELS:
            _cache.popitem(last=False)
        return _cache[key]


def load_cached(model: str, device: str = "auto") -> Generator:
    """A Generator for `model` (shipped name, run checkpoint or export, local folder, Hub id), loaded once
    and kept among the last MAX_CACHED_MODELS used."""
    return _loaded(model, device).generator


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


# ---- streaming ----

class _TokenQueue:
    """A transformers streamer (the `streamer=` protocol of `generate`: put() per step, end() once) that
    hands the new token ids to the consuming thread. The first put() is the prompt and is skipped."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.queue.put(value.reshape(-1).tolist())

    def end(self) -> None:
        self.queue.put(None)


def stream_text(model: str, prompt: str, params: SamplingParams, *, seed: int = 0,
                device: str = "auto") -> Iterator[str]:
    """The answer of `model` to one user prompt (chat template applied) as it grows: yields the whole
    text so far after each new token. Each text extends the one before (a token that ends inside a
    multi-byte character waits for the rest of it), and the last equals the non-streamed answer.

    Generation runs in a thread, as with transformers' TextIteratorStreamer; the text is decoded here
    from all token ids so far rather than from word-sized pieces, so the final text is exactly the
    batch decode. Sampling is seeded with `seed` right before generating."""
    loaded = _loaded(model, device)
    gen = loaded.generator
    model = gen.engine.model
    ids = torch.tensor([chat_prompt_ids(gen.tokenizer, prompt)], device=next(model.parameters()).device)
    # The engine's own generation settings: what Generator.generate and the batch compare use.
    settings = gen.engine.generation_kwargs(replace(params, n=1, seed=seed), torch.zeros(1, dtype=torch.long))
    streamer = _TokenQueue()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            with loaded.lock, torch.no_grad(), amp_context(ids.device):
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=streamer, **settings)
        except BaseException as e:  # noqa: BLE001 - handed to the consuming thread
            failure.append(e)
        finally:
            streamer.end()

    thread = threading.Thread(target=run, name="compare-stream", daemon=True)
    thread.start()
    tokens: list[int] = []
    shown = ""
    while (new := streamer.queue.get()) is not None:
        tokens += new
        text = gen.tokenizer.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
        if text != shown and text.startswith(shown):
            shown = text
            yield shown
    thread.join()
    if failure:
        raise failure[0]
    final = gen.tokenizer.decode(tokens, skip_special_tokens=True)
    if final != shown or not tokens:
        yield final


def stream_answer(model: str, prompt: str, params: SamplingParams, *, seed: int = 0,
                  device: str = "auto") -> Iterator[str]:
    """The same answer as new pieces of text, for `st.write_stream`."""
    shown = ""
    for text in stream_text(model, prompt, params, seed=seed, device=device):
        yield text[len(shown):]
        shown = text


def stream_answers(model_a: str, model_b: str, prompt: str, params: SamplingParams, *, seed: int = 0,
                   device: str = "auto") -> Iterator[tuple[str, str]]:
    """Both models' answers to one prompt as (text_a, text_b) so far, with the same sampling settings
    and the same seed. Greedy answers are generated at once, side by side; sampled ones one after the
    other, because concurrent generations would draw from the one global random generator in an
    unpredictable order and neither answer would be reproducible from the seed."""
    texts = ["", ""]
    if not params.greedy:
        for i, model in enumerate((model_a, model_b)):
            for text in stream_text(model, prompt, params, seed=seed, device=device):
                texts[i] = text
                yield texts[0], texts[1]
        return
    if _cache_key(model_a) == _cache_key(model_b):  # one model object, one lock: generate it once
        for text in stream_text(model_a, prompt, params, seed=seed, device=device):
            yield text, text
        return
    _loaded(model_a, device), _loaded(model_b, device)  # load in this thread, so errors surface here
    events: queue.Queue = queue.Queue()

    def pump(i: int, model: str) -> None:
        try:
            for text in stream_text(model, prompt, params, seed=seed, device=device):
                events.put((i, text, None))
        except BaseException as e:  # noqa: BLE001 - re-raised in the consuming thread
            events.put((i, None, e))
        events.put((i, None, None))

    threads = [threading.Thread(target=pump, args=(i, m), daemon=True) for i, m in enumerate((model_a, model_b))]
    for t in threads:
        t.start()
    running = 2
    while running:
        i, text, error = events.get()
        if error is not None:
            raise error
        if text is None:
            running -= 1
            continue
        texts[i] = text
        yield texts[0], texts[1]


# ---- scored comparison on a data file ----

@dataclass
class ModelScores:
    model: str
    accuracy: float    # the first sample of each question (the greedy answer when k = 1)
    pass_at_k: float   # any of the k samples correct
    maj_at_k: float    # the majority answer correct
    mean_at_k: float   # fraction of all samples correct


@dataclass
class CompareResult:
    data_file: str
    k: int
    temperature: float
    max_new_tokens: int
    seed: int
    a: ModelScores
    b: ModelScores
    difference: float  # accuracy of B minus accuracy of A (first samples, paired by question)
    ci_low: float      # 95% interval of the difference (paired normal approximation)
    ci_high: float
    questions: list[dict]      # per question: index, data_source, prompt, ground_truth, a, b (responses, preds, ...)
    disagreements: list[dict]  # questions one model answers correctly and the other not (first samples)

    @property
    def n(self) -> int:
        return len(self.questions)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sample_file(gen: Generator, items: list[dict], params: SamplingParams, *, seed: int, batch_size: int,
                 custom_fn: Callable | None, gsm8k_scorer: str, timeout_s: float,
                 report: Callable[[int], None]) -> list[dict]:
    """k samples per question from one model, each scored by its data source's reward."""
    out: list[dict] = []
    k = params.n
    params = replace(params, seed=seed)
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        batch = gen.engine.generate([it["prompt_ids"] for it in chunk], params, first_row=start * k)
        texts = gen.tokenizer.batch_decode(batch.responses * batch.response_mask, skip_special_tokens=True)
        scored = score_batch([it["data_source"] for it in chunk for _ in range(k)], texts,
                             [it["ground_truth"] for it in chunk for _ in range(k)],
                             [it["extra_info"] for it in chunk for _ in range(k)],
                             custom_fn=custom_fn, gsm8k_scorer=gsm8k_scorer, timeout_s=timeout_s)
        for j in range(len(chunk)):
            rows = range(j * k, (j + 1) * k)
            out.append({"responses": [texts[r] for r in rows], "preds": [scored.preds[r] for r in rows],
                        "scores": [scored.scores[r] for r in rows],
                        "correct": [is_correct(scored.scores[r], scored.parts[r]) for r in rows]})
        report(len(out))
    return out


def _model_scores(model: str, samples: list[dict], k: int) -> ModelScores:
    n = len(samples)
    first = [s["correct"][0] for s in samples]
    votes = []
    for s in samples:
        winner = majority_vote(s["preds"])
        votes.append(s["correct"][0 if winner is None else winner])  # nothing extracted: the first sample
    return ModelScores(model=model, accuracy=sum(first) / n,
                       pass_at_k=sum(pass_at_k(k, sum(s["correct"]), k) for s in samples) / n,
                       maj_at_k=sum(votes) / n,
                       mean_at_k=sum(sum(s["correct"]) / k for s in samples) / n)


def compare_on_file(model_a: str, model_b: str, data_file: str | Path, *, k: int = 1, limit: int = 0,
                    temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 128,
                    max_prompt_length: int = 512, seed: int = 0, batch_size: int = 16, device: str = "auto",
                    custom_fn: Callable | None = None, gsm8k_scorer: str = "verl", timeout_s: float = 10.0,
                    progress: Progress | None = None) -> CompareResult:
    """Both models on the questions of a parquet file: k answers per question and model (greedy when
    k = 1, else sampled at `temperature` with the same seed for both), each scored by the data set's
    reward (GSM8K rows by the rule `gsm8k_scorer` names, as reward.gsm8k_scorer). Reports accuracy,
    pass@k, maj@k per model, B - A with its paired 95% interval, and the questions where exactly one of
    the two (first samples) is right."""
    if k < 1:
        raise ValueError(f"k={k} must be at least 1")
    rows = data.load_rows(data_file)
    if limit:
        rows = rows[:limit]
    params = SamplingParams(n=k, temperature=temperature if k > 1 else 1.0, top_p=top_p,
                            max_new_tokens=max_new_tokens, greedy=k == 1)
    per_model: list[list[dict]] = []
    items: list[dict] = []
    for label, model in (("A", model_a), ("B", model_b)):
        gen = load_cached(model, device)
        # Each model reads the prompts with its own tokenizer (the two may differ).
        dataset = data.PromptDataset(rows, gen.tokenizer, max_prompt_length, truncation="left",
                                     source=str(data_file))
        items = [dataset[i] for i in range(len(dataset))]

        def report(done: int, label: str = label, total: int = len(items)) -> None:
            if progress is not None:
                progress(f"model {label}", done, total)

        with _loaded(model, device).lock:
            per_model.append(_sample_file(gen, items, params, seed=seed, batch_size=batch_size, custom_fn=custom_fn,
                                          gsm8k_scorer=gsm8k_scorer, timeout_s=timeout_s, report=report))

    samples_a, samples_b = per_model
    questions = [{"index": it["index"], "data_source": it["data_source"], "prompt": it["prompt_text"],
                  "question": _question_text(it["messages"]), "ground_truth": it["ground_truth"], "a": sa, "b": sb}
                 for it, sa, sb in zip(items, samples_a, samples_b, strict=True)]
    first_a = [float(q["a"]["correct"][0]) for q in questions]
    first_b = [float(q["b"]["correct"][0]) for q in questions]
    diff, low, high = paired_difference_ci(first_a, first_b)
    disagreements = [
        {"index": q["index"], "question": q["question"], "ground_truth": q["ground_truth"],
         "answer_a": q["a"]["responses"][0], "answer_b": q["b"]["responses"][0],
         "pred_a": q["a"]["preds"][0], "pred_b": q["b"]["preds"][0],
         "correct_a": q["a"]["correct"][0], "correct_b": q["b"]["correct"][0]}
        for q in questions if q["a"]["correct"][0] != q["b"]["correct"][0]]
    return CompareResult(data_file=str(data_file), k=k, temperature=params.temperature if k > 1 else 0.0,
                         max_new_tokens=max_new_tokens, seed=seed, a=_model_scores(str(model_a), samples_a, k),
                         b=_model_scores(str(model_b), samples_b, k), difference=diff, ci_low=low, ci_high=high,
                         questions=questions, disagreements=disagreements)


def _question_text(messages: list[dict]) -> str:
    users = [m.get("content", "") for m in messages if m.get("role") == "user"]
    return str(users[-1] if users else (messages[-1].get("content", "") if messages else ""))


# ---- saved evaluations of a run ----

def resolve_checkpoint(run_dir: str | Path, checkpoint: str | Path) -> Path:
    """A checkpoint of the run by folder name ("step_4"), "export", or a path."""
    run_dir = Path(run_dir)
    name = str(checkpoint)
    for candidate in (run_dir / "checkpoints" / name, run_dir / name) if "/" not in name else ():
        if is_model_folder(candidate):
            return candidate
    path = Path(name).expanduser()
    if is_model_folder(path):
        return path

    known = [p.name for p in list_checkpoints(run_dir)] + (["export"] if (run_dir / "export").is_dir() else [])
    raise FileNotFoundError(f"run {run_dir.name} has no checkpoint {name!r}; it has: {', '.join(known) or 'none'}")


def evaluate_checkpoint(run_dir: str | Path, checkpoint: str | Path, data_file: str | Path, *, limit: int = 0,
                        max_new_tokens: int | None = None, device: str = "auto",
                        progress: Callable[[int, int], None] | None = None) -> Path:
    """Greedy accuracy of one checkpoint of a run on a parquet file, scored as the run scores (its
    custom reward function when it has one, its GSM8K rule). Writes `<run>/evals/<checkpoint>__<data file stem>.json`
    (metrics, per-question records, settings, timestamp) and returns that path."""
    run_dir = Path(run_dir)
    ckpt = resolve_checkpoint(run_dir, checkpoint)
    cfg = read_run_config(run_dir)
    custom_fn = None
    if config_get(cfg, "custom_reward_function.path"):
        custom_fn = load_custom_reward(config_get(cfg, "custom_reward_function.path"),
                                               config_get(cfg, "custom_reward_function.name") or "compute_score")
    max_new_tokens = int(max_new_tokens or config_get(cfg, "data.max_response_length") or 128)
    gen = load_cached(str(ckpt), device)
    with _loaded(str(ckpt), device).lock:
        result = gen.evaluate(data_file, limit=limit, max_new_tokens=max_new_tokens,
                              max_prompt_length=int(config_get(cfg, "data.max_prompt_length") or 512),
                              custom_fn=custom_fn, timeout_s=float(config_get(cfg, "reward.timeout_s") or 10.0),
                              # a run configured before the key existed was scored by the lenient rule
                              gsm8k_scorer=config_get(cfg, "reward.gsm8k_scorer") or "lenient", progress=progress)
    record = {"run": run_dir.name, "checkpoint": ckpt.name, "model_path": str(ckpt), "step": checkpoint_step(ckpt),
              "data_file": str(data_file), "limit": limit, "n": len(result.records),
              "max_new_tokens": max_new_tokens, "metrics": result.metrics, "timestamp": time.time(),
              "records": result.records}
    out = run_dir / "evals" / f"{ckpt.name}__{Path(data_file).stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, out)
    return out


def list_evaluations(run_dir: str | Path) -> list[dict]:
    """The saved evaluations of a run, newest first, without their per-question records (each dict has
    its file as "path"). Unreadable files are skipped."""
    folder = Path(run_dir) / "evals"
    found = []
    for path in folder.glob("*.json") if folder.is_dir() else ():
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict):
            record.pop("records", None)
            found.append({**record, "path": str(path)})
    return sorted(found, key=lambda r: r.get("timestamp") or 0, reverse=True)
