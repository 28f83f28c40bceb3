"""`python -m backend ...`: the command line over the engine. Everything the UI does is one of these."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from backend.core.config import ConfigError

if TYPE_CHECKING:
    from backend.core.config import Config
    from backend.core.runs import RunDir
    from backend.engine.worker_group import WorkerOutOfMemory


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ---- data ----

def cmd_data_make_sample(args: argparse.Namespace) -> int:
    from backend.core import data

    paths = data.write_sample_sets(args.out, seed=args.seed, n_train=args.n_train, n_val=args.n_val)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


def cmd_data_make_calculator(args: argparse.Namespace) -> int:
    from backend.core import data

    paths = data.write_calculator_sets(args.out, seed=args.seed, n_train=args.n_train, n_val=args.n_val,
                                       n_demos=args.n_demos)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


def cmd_data_gsm8k(args: argparse.Namespace) -> int:
    from backend.core import data

    n = data.convert_gsm8k(args.input, args.output, split=args.split, limit=args.limit)
    print(f"wrote {n} rows to {args.output}")
    return 0


# ---- train ----

class _Tee:
    """Write to the console and to the run's log file, so logs/ holds what the user saw."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        self.log.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


def cmd_train(args: argparse.Namespace) -> int:
    from backend.core.config import load_config

    cfg = load_config(None if args.config == "defaults" else args.config, args.overrides)
    if args.run_dir:
        _starting(Path(args.run_dir))
    rc, _ = _train(cfg, args.run_dir, quiet=args.quiet)
    return rc


def _starting(run_dir: Path) -> None:
    """Say on a launched run's status line that its process has started: the trainer's first stage comes after
    its imports (torch, transformers, Ray), seconds on a CPU and 10-18 s on a GPU machine, which the run's page
    would otherwise show as `queued`, as if waiting for its turn."""
    from backend.core.runs import RunDir, read_status

    if (read_status(run_dir) or {}).get("state") == "queued":
        RunDir(run_dir).write_status("queued", stage="importing torch, transformers and Ray",
                                     stage_started=time.time())


def _train(cfg, run_dir: str | None, *, quiet: bool) -> tuple[int, Path]:
    """Train `cfg` with the console teed into the run's logs/train.log; (exit code, run directory)."""
    _quiet_transformers()
    from backend.engine.trainer import RunStopped, Trainer
    from backend.engine.worker_group import WorkerError, WorkerOutOfMemory

    trainer = Trainer(cfg, run_dir, show_progress=not quiet)
    trainer.run.create()
    log = open(trainer.run.logs / "train.log", "a")  # noqa: SIM115 - lives as long as the run
    sys.stdout, sys.stderr = _Tee(sys.__stdout__, log), _Tee(sys.__stderr__, log)
    print(f"run directory: {trainer.run.root}")
    try:
        trainer.train()
    except RunStopped:
        print("run stopped; continue it with trainer.resume_mode=auto", file=sys.stderr)
        _end_stopped_process()
    except WorkerError as e:
        # Printed here, not by Ray's exception hook: that hook reports the error to the Ray head first, and
        # with the head gone it blocked until Ray ended the process 60 s later, printing nothing.
        traceback.print_exc()
        if isinstance(e, WorkerOutOfMemory):
            advise_after_out_of_memory(trainer.run, cfg, e)
        return 1, trainer.run.root
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        log.close()
    print(f"done: {trainer.run.root}")
    return 0, trainer.run.root


def advise_after_out_of_memory(run: RunDir, cfg: Config, error: WorkerOutOfMemory) -> dict:
    """Add the planner's view of a rank that ran out of memory (its prediction for that phase, what would fit)
    to the diagnosis the trainer recorded in status.json, and print it."""
    from backend.core.runs import read_status
    from backend.services.planner import after_out_of_memory

    try:
        advice = after_out_of_memory(cfg, error.memory, str(error))
    except Exception as planner_error:  # noqa: BLE001 - the failure is recorded already; this only adds to it
        advice = {"note": f"the planner could not say more ({type(planner_error).__name__}: {planner_error})"}
    diagnosis = {**((read_status(run.root) or {}).get("diagnosis") or {}), **advice}
    run.write_status("failed", diagnosis=diagnosis)
    print(f"out of memory in {diagnosis.get('phase') or diagnosis.get('call')}: {advice.get('note', '')}",
          file=sys.stderr)
    for line in advice.get("suggestions", []):
        print(f"  would fit: {line}", file=sys.stderr)
    return diagnosis


def _end_stopped_process() -> NoReturn:
    """End this process now (exit code 3): a stop signal asked it to, and the run has recorded that it
    stopped (status, metrics, trackers closed). The private Ray it started is killed, not shut down: a
    stop must end within the launcher's grace of seconds, and Ray's orderly shutdown takes that long alone
    (longer when the workers are in the middle of a call)."""
    _exit_killing_children(3)


def _exit_killing_children(rc: int) -> NoReturn:
    """Flush the console, kill every process this one started (its private Ray) and exit with `rc` at once."""
    from backend.engine.worker_group import end_children

    sys.stdout.flush()
    sys.stderr.flush()
    end_children()
    os._exit(rc)


def end_process(rc: int) -> NoReturn:
    """Exit `python -m backend` with `rc`. A private Ray the command started (train, recipe, eval, generate)
    is killed with its processes rather than shut down: everything the command keeps is on disk by then,
    and Ray's orderly shutdown held a finished run's process for seconds after its final status (longer
    with the Ray head gone), while the UI, a script or a test waited for it to end. A Ray cluster joined by
    address is left properly (its head records the job as finished)."""
    worker_group = sys.modules.get("backend.engine.worker_group")  # not imported: no Ray to end, and none to import
    if worker_group is not None and worker_group.runs_private_ray():
        _exit_killing_children(rc)
    sys.exit(rc)


def cmd_sft(args: argparse.Namespace) -> int:
    from backend.core.config import load_config
    from backend.core.runs import new_run_dir
    from backend.engine.sft import train_sft

    _quiet_transformers()
    cfg = load_config(None if args.config == "defaults" else args.config, args.overrides)
    name = f"{cfg.trainer.experiment_name}-sft" if cfg.trainer.experiment_name else "sft"
    run_dir = Path(args.run_dir) if args.run_dir else new_run_dir(cfg.trainer.runs_root, name)
    print(f"run directory: {run_dir}")
    export = train_sft(cfg, run_dir, show_progress=not args.quiet)
    print(f"done: {export} (use it as actor_rollout_ref.model.path)")
    return 0


def cmd_recipe(args: argparse.Namespace) -> int:
    from backend.core.config import load_config
    from backend.services import recipes

    if args.name == "list":
        for recipe in recipes.RECIPES.values():
            print(f"{recipe.name:<16} {recipe.about}  ({recipe.config.relative_to(recipes.CONFIGS_DIR.parent)})")
        return 0
    recipe = recipes.get_recipe(args.name)
    # Validate before making data: a mistyped override must not cost a GSM8K conversion first.
    load_config(recipe.config, args.overrides)
    inputs = {"gsm8k_jsonl": args.gsm8k_jsonl, "data_dir": args.data_dir, "overrides": args.overrides,
              "show_progress": not args.quiet}
    # What the recipe made (its data, a warm-started model) is where its run starts, whatever else is overridden.
    made, notes = recipes.prepare(recipe, inputs)
    cfg = load_config(recipe.config, [*args.overrides, *made])
    rc, run_dir = _train(cfg, args.run_dir, quiet=args.quiet)
    if rc == 0:
        result = recipes.write_report(run_dir, recipe, "python -m backend " + shlex.join(args.argv), notes)
        print(recipes.summary(result))
        print(f"report: {run_dir / 'recipe.json'}")
    return rc


def cmd_plot(args: argparse.Namespace) -> int:
    from backend.services.plotting import plot_metric

    print(plot_metric(args.runs, args.metric, args.out, labels=args.label, title=args.title, smooth=args.smooth,
                      max_step=args.max_step))
    return 0


# ---- replay ----

def cmd_replay(args: argparse.Namespace) -> int:
    """A dumped step's scoring and update again in this process; exit 1 when a value differs from the run's."""
    import pdb

    from backend.engine.replay import replay

    _quiet_transformers()
    run = pdb.Pdb().runcall if args.pdb else (lambda f, *a, **k: f(*a, **k))
    if args.pdb:
        print("pdb: set breakpoints (b backend/engine/workers.py:LINE, or in your reward function), then c")
    result = run(replay, args.dump, args.device, in_this_thread=args.pdb)
    print(f"step {result.step} replayed on {result.device}, one process, without Ray"
          + (", with deterministic algorithms only (trainer.deterministic)" if result.deterministic else ""))
    width = max([len(key) for key, *_ in result.rows()] + [6])
    print(f"{'metric':<{width}}  {'run':>14}  {'replay':>14}  equal")
    for key, logged, replayed, ok in result.rows():
        print(f"{key:<{width}}  {logged:>14.8g}  {replayed:>14.8g}  {'yes' if ok else 'NO'}")
    if result.scores is None:
        print(f"rewards: not scored again ({result.not_rescored})")
    else:
        print(f"rewards: {result.scores[0]} of {result.scores[1]} responses score as they did in the run")
    print("equal within tolerance" if result.equal() else "DIFFERENT from what the run logged")
    return 0 if result.equal() else 1


# ---- plan ----

class _LateOverridesParser(argparse.ArgumentParser):
    """key=value overrides may also come after the options (`plan c.yaml --gpu l4 data.x=1`)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        late = [a for a in rest if "=" in a and not a.startswith("-")]
        namespace.overrides = [*(namespace.overrides or []), *late]
        return namespace, [a for a in rest if a not in late]


def cmd_plan(args: argparse.Namespace) -> int:
    from backend.core.config import load_config
    from backend.services.planner import format_plan, plan

    overrides = [*args.overrides, *([f"trainer.n_gpus_per_node={args.gpus}"] if args.gpus is not None else [])]
    cfg = load_config(None if args.config == "defaults" else args.config, overrides)
    _quiet_transformers()
    result = plan(cfg, gpu=args.gpu)
    print(format_plan(result))
    return 0 if result.fits else 1


# ---- generate / eval ----

def cmd_generate(args: argparse.Namespace) -> int:
    from backend.engine.inference import generate

    _quiet_transformers()
    [answers] = generate(args.model, args.prompt, n=args.n, temperature=args.temperature, top_p=args.top_p,
                         max_new_tokens=args.max_new_tokens, device=args.device, seed=args.seed)
    for i, text in enumerate(answers):
        if args.n > 1:
            print(f"--- sample {i + 1}")
        print(text)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from backend.engine.inference import evaluate

    if not (args.model or args.run_dir):
        print("error: name a model (--model) or a run checkpoint (--run-dir [--checkpoint])", file=sys.stderr)
        return 2
    _quiet_transformers()
    bar = tqdm(desc="eval", unit="prompt")

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    if args.run_dir:
        return _eval_checkpoint(args, progress, bar)
    args.max_new_tokens = args.max_new_tokens or 128
    result = evaluate(args.model, args.data, limit=args.limit, max_new_tokens=args.max_new_tokens,
                      batch_size=args.batch_size, device=args.device, progress=progress)
    bar.close()
    for key, value in result.metrics.items():
        print(f"{key}: {value:.4f}")
    if args.output:
        Path(args.output).write_text(json.dumps({"metrics": result.metrics, "records": result.records}, indent=1))
        print(f"records: {args.output}")
    return 0


def _eval_checkpoint(args: argparse.Namespace, progress, bar) -> int:
    """`eval --run-dir RUN [--checkpoint step_N]`: scored as the run scores, saved in RUN/evals/."""
    from backend.core.runs import latest_checkpoint
    from backend.services.compare import evaluate_checkpoint

    checkpoint = args.checkpoint or latest_checkpoint(args.run_dir)
    if checkpoint is None:
        bar.close()
        print(f"error: run {args.run_dir} has no checkpoint yet; name one with --checkpoint", file=sys.stderr)
        return 2
    try:
        out = evaluate_checkpoint(args.run_dir, checkpoint, args.data, limit=args.limit,
                                  max_new_tokens=args.max_new_tokens, device=args.device, progress=progress)
    except FileNotFoundError as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    bar.close()
    for key, value in json.loads(out.read_text())["metrics"].items():
        print(f"{key}: {value:.4f}")
    print(f"evaluation: {out}")
    return 0


# ---- export ----

def cmd_export(args: argparse.Namespace) -> int:
    from backend.services.export import export_checkpoint

    _quiet_transformers()
    out = export_checkpoint(args.checkpoint, args.output, tokenizer_source=args.tokenizer, overwrite=args.overwrite)
    print(f"exported {args.checkpoint} to {out}")
    return 0


# ---- ui / docs / version ----

def _package_root() -> Path:
    return Path(__file__).resolve().parent


def workbench_files() -> tuple[Path, Path | None]:
    """The workbench's entry script and its Streamlit defaults (config.toml, or None): inside the installed
    package (`backend/workbench/`, as the wheel lays them out) or, from a source checkout, the repository."""
    installed = _package_root() / "workbench"
    for app, conf in ((installed / "app" / "main.py", installed / "streamlit" / "config.toml"),
                      (_package_root().parent / "app" / "main.py",
                       _package_root().parent / ".streamlit" / "config.toml")):
        if app.is_file():
            return app, conf if conf.is_file() else None
    raise FileNotFoundError(f"the workbench app is not installed next to {_package_root()} (looked for "
                            f"{installed / 'app' / 'main.py'}); reinstall grpo-workbench")


def streamlit_command(extra: list[str] | None = None) -> list[str]:
    """`python -m streamlit run <app/main.py>` with the shipped defaults as flags (so they hold in any working
    folder), bound to 127.0.0.1; `extra` comes last, so a flag given there wins."""
    import tomllib

    app, conf = workbench_files()
    flags: list[str] = []
    if conf is not None:
        for section, values in tomllib.loads(conf.read_text()).items():
            if section == "theme":  # a theme as flags would override a user's own .streamlit/config.toml
                continue
            for key, value in values.items():
                value = str(value).lower() if isinstance(value, bool) else str(value)
                flags.append(f"--{section}.{key}={value}")
    flags = [f for f in flags if not f.startswith("--server.address=")] + ["--server.address=127.0.0.1"]
    return [sys.executable, "-m", "streamlit", "run", str(app), *flags, *(extra or [])]


class _PassThroughParser(argparse.ArgumentParser):
    """`ui`'s parser: arguments it does not know are kept for streamlit instead of being an error."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        namespace.streamlit_args = [a for a in rest if a != "--"]
        return namespace, []


def cmd_sweep(args: argparse.Namespace) -> int:
    import yaml
    from tqdm import tqdm

    from backend.core.config import load_config
    from backend.services import sweeps

    try:
        if args.resume:
            folder = Path(args.resume)
            spec = sweeps.read_spec(folder)
        else:
            if args.spec:
                spec = sweeps.spec_from_dict(yaml.safe_load(Path(args.spec).read_text()), args.spec)
            else:
                spec = sweeps.SweepSpec(
                    params=sweeps.parse_grid(args.grid) + sweeps.parse_ranges(args.ranges), metric=args.metric,
                    direction=args.direction, trials=args.trials, steps=args.steps, parallel=args.parallel,
                    early_stopping=args.early_stopping, startup_trials=args.startup_trials,
                    min_steps=args.min_steps)
            base = load_config(None if args.config == "defaults" else args.config, args.overrides)
            name = args.name or sweeps.default_name()
            folder = sweeps.create_sweep(base, spec, name=name, runs_root=args.runs_root)
    except (sweeps.SweepError, OSError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"sweep: {folder} ({spec.total_trials()} trials, ranked by {spec.metric}, {spec.direction})")
    bar = None if args.quiet else tqdm(total=spec.total_trials(), desc="trials", unit="trial")

    def show(sweep: dict) -> None:
        done = sum(t.state not in ("running", "waiting") for t in sweep["trials"])
        bar.update(done - bar.n)
        best = sweep["best"]
        bar.set_postfix_str(f"running {sum(t.state == 'running' for t in sweep['trials'])}"
                            + (f" | best #{best.number} {best.value:.4g}" if best else ""))

    state = sweeps.run_sweep(folder, on_change=None if bar is None else show)
    if bar is not None:
        bar.close()
    sweep = sweeps.read_sweep(folder)
    for t in sweep["trials"]:
        values = " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in t.values.items())
        value = "-" if t.value is None else f"{t.value:.4g}"
        print(f"#{t.number:<3} {t.state:<9} {value:>10}  {values}  {t.reason or ''}".rstrip())
    best = sweep["best"]
    print(f"sweep {state}; best: " + (f"#{best.number} {spec.metric}={best.value:.4g} ({best.run})" if best
                                      else "none (no trial finished)"))
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    import subprocess

    try:
        command = streamlit_command(args.streamlit_args)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_command:
        print(" ".join(command))
        return 0
    return subprocess.call(command)  # a list, no shell; the workspace is the current folder


def cmd_docs_config(args: argparse.Namespace) -> int:
    from backend.core.docs import write_config_reference

    print(f"wrote {write_config_reference(args.output)}")
    return 0


def _version() -> str:
    from backend import __version__

    return __version__


# ---- config: verl interop ----

def cmd_config_from_verl(args: argparse.Namespace) -> int:
    from backend.core.config import dump_yaml
    from backend.services.interop import from_verl_script

    raw, notes = from_verl_script(Path(args.script).read_text())
    for note in notes:
        print(f"not carried over: {note}", file=sys.stderr)
    text = dump_yaml(raw)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def cmd_config_to_verl(args: argparse.Namespace) -> int:
    from backend.core.config import load_config
    from backend.services.interop import to_verl_command

    print(to_verl_command(load_config(None if args.config == "defaults" else args.config, args.overrides,
                                      validate=False)))
    return 0


# ---- parser ----

def _add_run_options(p: argparse.ArgumentParser) -> None:
    """The options of every command that trains: where the run goes, and whether to draw a progress bar."""
    p.add_argument("--run-dir", default=None, help="run directory (default: a new folder under trainer.runs_root)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m backend", description="GRPO Workbench engine")
    p.add_argument("--version", action="version", version=f"grpo-workbench {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("data", help="make or convert data sets").add_subparsers(dest="data_command", required=True)
    ms = d.add_parser("make-sample", help="write the synthetic arithmetic sets into sample_data/")
    ms.add_argument("--out", default="sample_data")
    ms.add_argument("--seed", type=int, default=0)
    ms.add_argument("--n-train", type=int, default=2000)
    ms.add_argument("--n-val", type=int, default=200)
    ms.set_defaults(func=cmd_data_make_sample)
    mc = d.add_parser("make-calculator", help="write multi-digit problems for the calculator tool and demonstrations "
                                             "of its use (calculator_{train,val,demos}.parquet)")
    mc.add_argument("--out", default="data")
    mc.add_argument("--seed", type=int, default=0)
    mc.add_argument("--n-train", type=int, default=2000)
    mc.add_argument("--n-val", type=int, default=200)
    mc.add_argument("--n-demos", type=int, default=512)
    mc.set_defaults(func=cmd_data_make_calculator)
    gs = d.add_parser("gsm8k", help="convert GSM8K's official JSONL into verl-shaped parquet")
    gs.add_argument("--input", required=True)
    gs.add_argument("--output", required=True)
    gs.add_argument("--split", default="train")
    gs.add_argument("--limit", type=int, default=None)
    gs.set_defaults(func=cmd_data_gsm8k)

    t = sub.add_parser("train", help="train from a YAML config plus key.path=value overrides")
    t.add_argument("config", help="YAML config file, or `defaults` for the schema defaults (no file)")
    t.add_argument("overrides", nargs="*", help="e.g. actor_rollout_ref.rollout.n=8")
    _add_run_options(t)
    t.set_defaults(func=cmd_train)

    sf = sub.add_parser("sft", help="supervised warm-start on demonstrations (sft.* keys), before an RL run",
                        description="Fine-tune actor_rollout_ref.model.path on sft.train_files (conversations; loss on "
                                    "the assistant messages) and write a run directory whose export/ an RL run "
                                    "starts from.")
    sf.add_argument("config", help="YAML config file, or `defaults`")
    sf.add_argument("overrides", nargs="*", help="e.g. sft.train_files=[data/calculator_demos.parquet] sft.steps=200")
    _add_run_options(sf)
    sf.set_defaults(func=cmd_sft)

    r = sub.add_parser("recipe", help="train a named recipe and report held-out accuracy before and after",
                       description="Train a recipe (configs/recipes/NAME.yaml) and write <run>/recipe.json with "
                                   "held-out accuracy before and after, and its curve in <run>/plots/. "
                                   "`recipe list` names them.")
    r.__class__ = _LateOverridesParser
    r.add_argument("name", help="arithmetic, arithmetic-cpu, gsm8k, or list")
    r.add_argument("overrides", nargs="*", help="e.g. trainer.total_training_steps=40")
    r.add_argument("--gsm8k-jsonl", default=None, help="gsm8k: GSM8K's train.jsonl (a held-out part is split off)")
    r.add_argument("--data-dir", default="data", help="where a recipe writes the data it makes (default: data/)")
    _add_run_options(r)
    r.set_defaults(func=cmd_recipe)

    sw = sub.add_parser("sweep", help="train a config over a grid or random ranges of keys, rank the trials by a "
                                      "metric and stop the bad ones early (Optuna)",
                        description="Each trial is an ordinary run under trainer.runs_root; the sweep's state is in "
                                    "<runs_root>/sweeps/<name>/ and `--resume` continues it after a restart. Give "
                                    "overrides before --grid/--range.")
    sw.add_argument("config", nargs="?", default="defaults", help="YAML config file, or `defaults`")
    sw.add_argument("overrides", nargs="*", help="overrides of the base config, e.g. trainer.total_training_steps=20")
    sw.add_argument("--grid", nargs="+", default=[], metavar="KEY=V1,V2",
                    help="every combination of these values, e.g. actor_rollout_ref.actor.optim.lr=1e-6,3e-6,1e-5")
    sw.add_argument("--range", nargs="+", default=[], dest="ranges", metavar="KEY=LOW:HIGH[:log]",
                    help="random values in a range (with --trials), e.g. "
                         "actor_rollout_ref.actor.optim.lr=1e-7:1e-4:log")
    sw.add_argument("--spec", default=None, help="a sweep YAML (grid:, ranges:, metric:, direction:, ...) instead")
    sw.add_argument("--trials", type=int, default=None, help="how many random trials (with --range)")
    sw.add_argument("--metric", default="critic/score/mean", help="the logged metric trials are ranked by")
    sw.add_argument("--direction", choices=("max", "min"), default="max")
    sw.add_argument("--steps", type=int, default=None, help="training steps a trial (default: the config's)")
    sw.add_argument("--parallel", type=int, default=1,
                    help="trials at once; 0: as many as fit (GPUs: by the planner, CPU: one per two cores)")
    sw.add_argument("--early-stopping", choices=("off", "median", "halving"), default="off",
                    help="stop trials whose metric trails the finished ones' (median); or of N trials keep the best "
                    "N/4 at step S, N/16 at 4S..., ranked once every running trial has reached it (halving)")
    sw.add_argument("--startup-trials", type=int, default=2, help="finished trials before any is stopped early")
    sw.add_argument("--min-steps", type=int, default=1, help="steps a trial runs before it can be stopped early "
                    "(S: halving's first rung)")
    sw.add_argument("--name", default="", help="the sweep's folder name and its trials' prefix")
    sw.add_argument("--runs-root", default=None, help="default: the config's trainer.runs_root")
    sw.add_argument("--resume", metavar="SWEEP_DIR", default=None, help="continue a sweep after a restart")
    sw.add_argument("--quiet", action="store_true", help="no progress bar")
    sw.set_defaults(func=cmd_sweep)

    pt = sub.add_parser("plot", help="draw a metric of one or more runs against step into a PNG (or SVG)")
    pt.add_argument("runs", nargs="+", help="run directories")
    pt.add_argument("--metric", default="val/accuracy", help="a metrics.jsonl key (default: val/accuracy)")
    pt.add_argument("--out", required=True, help="image file to write (.png or .svg)")
    pt.add_argument("--label", action="append", default=None,
                    help="legend name of a run; give it once per run, in order (default: folder names)")
    pt.add_argument("--title", default=None)
    pt.add_argument("--smooth", type=int, default=1, help="trailing mean over this many points (default 1: raw)")
    pt.add_argument("--max-step", type=int, default=None, help="draw steps up to this one only (compare runs of "
                                                                 "different lengths over the same steps)")
    pt.set_defaults(func=cmd_plot)

    rp = sub.add_parser("replay", help="run a dumped step's update again in one process, without Ray (--pdb to "
                                       "step through it)",
                        description="Replay runs/<id>/dumps/step_N (written for each step in trainer.dump_steps, or "
                                    "by the Runs page's 'Dump the next step'): the reward scoring of its responses "
                                    "and its actor update from the weights it started from, on one rank, and prints "
                                    "the loss, KL, clip fraction and grad norm next to the run's. Exit code 0: "
                                    "equal within tolerance, 1: different.")
    rp.add_argument("dump", help="runs/<id>/dumps/step_N")
    rp.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="where to run it (equal values need the device the run used)")
    rp.add_argument("--pdb", action="store_true", help="start under pdb, rewards scored in this thread")
    rp.set_defaults(func=cmd_replay)

    from backend.services.gpus import GPUS

    pl = sub.add_parser("plan", help="will it fit? peak GPU memory per phase and step time of a config, before launch",
                        description="Predict peak memory per worker in each phase of a training step and the step "
                                    "time; say whether it fits the GPU and what to change if not. Exit code 0: "
                                    "fits, 1: does not fit, 2: the config is not valid.")
    pl.__class__ = _LateOverridesParser
    pl.add_argument("config", help="YAML config file, or `defaults` for the schema defaults (no file)")
    pl.add_argument("overrides", nargs="*", help="e.g. actor_rollout_ref.rollout.n=8")
    pl.add_argument("--gpu", default=None, choices=list(GPUS),
                    help="GPU kind to plan for (default: this machine: its GPU, else its CPU)")
    pl.add_argument("--gpus", type=int, default=None, help="GPUs per node (replaces trainer.n_gpus_per_node)")
    pl.set_defaults(func=cmd_plan)

    g = sub.add_parser("generate", help="answer one prompt with a model")
    g.add_argument("--model", required=True, help="shipped name, run export/checkpoint folder, or Hub id")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="greedy accuracy of a model on a parquet file, scored by its reward")
    e.add_argument("--model", default=None, help="shipped name, run export/checkpoint folder, or Hub id")
    e.add_argument("--run-dir", default=None,
                   help="evaluate a checkpoint of this run instead (scored as the run scores; saved in <run>/evals/)")
    e.add_argument("--checkpoint", default=None, help="with --run-dir: step_N or export (default: the latest step)")
    e.add_argument("--data", required=True)
    e.add_argument("--max-new-tokens", type=int, default=None,
                   help="default 128 (with --run-dir: the run's data.max_response_length)")
    e.add_argument("--batch-size", type=int, default=32)
    e.add_argument("--limit", type=int, default=0, help="first N rows only (0 = all)")
    e.add_argument("--output", default=None, help="write metrics and per-prompt records to this JSON file")
    e.add_argument("--device", default="auto")
    e.set_defaults(func=cmd_eval)

    x = sub.add_parser("export", help="turn a run checkpoint into a plain Hugging Face folder with a model card")
    x.add_argument("--checkpoint", required=True,
                   help="runs/<id>/checkpoints/step_N, a run's export/, or a model folder")
    x.add_argument("--output", required=True, help="folder to write (must not exist unless --overwrite)")
    x.add_argument("--tokenizer", default=None, help="tokenizer source when the run config does not name it")
    x.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    x.set_defaults(func=cmd_export)

    m = sub.add_parser("merge", help="merge a sharded checkpoint (one file set per worker) into a plain Hugging Face "
                                     "folder; the same as export")
    m.add_argument("checkpoint", help="runs/<id>/checkpoints/step_N")
    m.add_argument("--output", required=True, help="folder to write (must not exist unless --overwrite)")
    m.add_argument("--tokenizer", default=None, help="tokenizer source when the checkpoint holds none")
    m.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    m.set_defaults(func=cmd_export)

    c = sub.add_parser("config", help="convert configs to and from verl launch scripts")
    cs = c.add_subparsers(dest="config_command", required=True)
    fv = cs.add_parser("from-verl", help="read a verl launch script (python3 -m verl.trainer.main_ppo key=value ...)")
    fv.add_argument("script", help="the bash script")
    fv.add_argument("--output", default=None, help="YAML file to write (default: print it)")
    fv.set_defaults(func=cmd_config_from_verl)
    tv = cs.add_parser("to-verl", help="print the verl command line that trains a config")
    tv.add_argument("config", help="YAML config file, or `defaults`")
    tv.add_argument("overrides", nargs="*", help="e.g. actor_rollout_ref.rollout.n=8")
    tv.set_defaults(func=cmd_config_to_verl)

    u = sub.add_parser("ui", help="open the workbench (streamlit run on 127.0.0.1); other arguments go to streamlit",
                       description="Open the workbench. Arguments other than --print-command go to streamlit, "
                                   "e.g. `ui --server.port 8502`.")
    u.__class__ = _PassThroughParser
    u.add_argument("--print-command", action="store_true", help="print the streamlit command instead of running it")
    u.set_defaults(func=cmd_ui, streamlit_args=[])

    dc = sub.add_parser("docs", help="generate documentation").add_subparsers(dest="docs_command", required=True)
    dcc = dc.add_parser("config", help="write the config reference (docs/config.md) from the schema")
    dcc.add_argument("--output", default="docs/config.md")
    dcc.set_defaults(func=cmd_docs_config)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if not isinstance(e, _input_errors()):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


def _input_errors() -> tuple[type[Exception], ...]:
    """The errors a command reports in one line (bad input), not as a traceback. Imported once one is raised:
    their modules bring torch, a second or more before any command could start."""
    from backend.core.data import DataError
    from backend.core.models import ModelError
    from backend.engine.replay import ReplayError
    from backend.rewards.registry import RewardError
    from backend.services.interop import InteropError
    from backend.services.plotting import PlotError
    from backend.services.recipes import RecipeError

    return ConfigError, DataError, InteropError, ModelError, PlotError, RecipeError, ReplayError, RewardError
