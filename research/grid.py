"""Ablation grid: arms x seeds -> train -> evaluate -> compare with run_stats.

    python -m research.grid GRID.json --out runs/my-grid [--parallel 4] [--dry-run]

A grid file (JSON) names the arms and what they share:

    {
      "preset": "tiny",                       # optional: the embedded default
      "eval_data": "tiny:31337:100",          # one eval set for every cell
      "eval_flags": ["--backend", "vllm"],    # optional: more evaluation flags (python -m evaluation) for every cell
      "sweep_every": 25,                      # optional: checkpoints every 25 steps, each evaluated
      "seeds": [0, 1, 2],                     # training seeds, paired across arms
      "budget": {"max_steps": 100, "global_batch": 32, "per_device_batch": 32},
      "recipe": {"learning_rate": 1e-4},      # recipe keys every trained arm gets
      "baseline": "base",                     # the arm every other arm is compared with
      "arms": {
        "base": {"train": false},             # the untrained model, evaluated once
        "released": {},
        "cosine": {"recipe": {"lr_scheduler_type": "cosine"}},
        "token": {"env": {"OPSD_CLIP_MODE": "token"}},
        "sft": {"flags": ["--loss_type", "sft"]}
      }
    }

Each cell (arm, seed) is `opsd_train.py` with the arm's recipe, `OPSD_*`
variables and extra trainer flags, then `python -m evaluation` on its last checkpoint.
Seed s is the same training seed in every arm (same data order, same initial
rollout RNG), so arms are compared on paired seeds. A cell whose `eval.json`
exists is skipped; a cell with a partial run resumes from its last checkpoint,
so re-running the same command after an interruption finishes the grid. At the
end: `results.md` (one table, the verdict of `analysis.stats` compare of each arm
against the baseline) and `results.json` (every number) in the grid folder, and
`curves.png` beside them: each trained arm's training curves, the mean over its
seeds with the lowest-to-highest band (`python -m analysis.plots overlay --grid`). Each arm's
sampled tokens (the mean over its seeds of `tokens/sampled` at the last checkpoint, analysis.tokens)
stand next to its accuracy. The output ends with each evaluated cell's FINAL line and each arm's
verdict against the baseline (what quickstart.sh shows).

With `sweep_every: N`, trained cells save a checkpoint every N steps and evaluate every one
(`python -m evaluation RUN_FOLDER`, evaluation/sweep.py: one report per checkpoint, the cell's
`sweep.json` with accuracy against step, best against last); the arms' table still compares
the last checkpoints, and `results.md` / `results.json` add each arm's mean accuracy per step
(`results.json` also its mean sampled tokens per step), and `accuracy_vs_tokens.png` draws each
arm's accuracy against the tokens it sampled (`python -m analysis.stats tokens GRID_DIR`: the table).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from opsd.run_folder import write_text_atomic
from research import executors

REPO = Path(__file__).resolve().parents[1]  # the repository
BUDGET_DEFAULT = {"max_steps": 100, "global_batch": 32, "per_device_batch": 4}


class GridError(Exception):
    """A bad grid file; one line, exit 2."""


@dataclass(frozen=True)
class Arm:
    name: str
    train: bool = True
    recipe: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Grid:
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]
    eval_data: str | None
    preset: str | None
    budget: dict
    recipe: dict
    baseline: str
    eval_flags: tuple[str, ...] = ()
    sweep_every: int | None = None  # save and evaluate a checkpoint every this many steps


@dataclass(frozen=True)
class Cell:
    arm: Arm
    seed: int | None  # None: an untrained arm, evaluated once
    folder: Path

    @property
    def name(self) -> str:
        return self.arm.name if self.seed is None else f"{self.arm.name}/seed-{self.seed}"

    @property
    def report(self) -> Path:
        return self.folder / "eval.json"


def load_grid(path: str) -> Grid:
    """Read and check a grid file; every problem is one GridError line."""
    from opsd.config import SWITCH_VARIABLES

    where = path
    try:
        spec = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GridError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GridError(f"{where}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise GridError(f"{where}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg})") from None
    if not isinstance(spec, dict):
        raise GridError(f"{where}: expected a JSON object")
    known = {"preset", "eval_data", "eval_flags", "sweep_every", "seeds", "budget", "recipe", "baseline", "arms"}
    if unknown := sorted(set(spec) - known):
        raise GridError(f"{where}: unknown key {unknown[0]!r}; expected {', '.join(sorted(known))}")
    arms_spec = spec.get("arms")
    if not isinstance(arms_spec, dict) or not arms_spec:
        raise GridError(f"{where}: 'arms' must be a non-empty object of arm name -> settings")
    switches = set(SWITCH_VARIABLES.values())
    arms = []
    for name, value in arms_spec.items():
        if not isinstance(value, dict) or set(value) - {"train", "recipe", "env", "flags"}:
            raise GridError(f"{where}: arm {name!r} must be an object with train / recipe / env / flags")
        if not name.replace("-", "").replace("_", "").isalnum():
            raise GridError(f"{where}: arm name {name!r}: use letters, digits, - and _")
        env = value.get("env", {})
        if bad := sorted(set(env) - switches):
            raise GridError(f"{where}: arm {name!r}: {bad[0]} is not an OPSD switch ({', '.join(sorted(switches))})")
        arms.append(Arm(name, bool(value.get("train", True)), dict(value.get("recipe", {})),
                        {k: str(v) for k, v in env.items()}, tuple(map(str, value.get("flags", ())))))
    seeds = spec.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise GridError(f"{where}: 'seeds' must be a non-empty list of non-negative integers")
    if len(set(seeds)) != len(seeds):
        raise GridError(f"{where}: 'seeds' has a duplicate")
    budget = {**BUDGET_DEFAULT, **spec.get("budget", {})}
    if set(budget) != set(BUDGET_DEFAULT) or not all(isinstance(v, int) and v > 0 for v in budget.values()):
        raise GridError(f"{where}: 'budget' takes positive integers {', '.join(BUDGET_DEFAULT)}")
    if budget["global_batch"] % budget["per_device_batch"]:
        raise GridError(f"{where}: global_batch {budget['global_batch']} is not a multiple of "
                        f"per_device_batch {budget['per_device_batch']}")
    baseline = spec.get("baseline", arms[0].name)
    if baseline not in {a.name for a in arms}:
        raise GridError(f"{where}: baseline {baseline!r} is not an arm")
    eval_flags = spec.get("eval_flags", [])
    if not isinstance(eval_flags, list) or not all(isinstance(f, str) for f in eval_flags):
        raise GridError(f"{where}: 'eval_flags' must be a list of strings (python -m evaluation's flags)")
    _check_eval_flags(eval_flags, where)
    sweep_every = spec.get("sweep_every")
    if sweep_every is not None and not (isinstance(sweep_every, int) and not isinstance(sweep_every, bool)
                                        and 0 < sweep_every <= budget["max_steps"]):
        raise GridError(f"{where}: 'sweep_every' must be a whole number of steps from 1 to max_steps "
                        f"({budget['max_steps']}), got {sweep_every!r}")
    grid = Grid(tuple(arms), tuple(seeds), spec.get("eval_data"), spec.get("preset"), budget,
                dict(spec.get("recipe", {})), baseline, tuple(eval_flags), sweep_every)
    for arm in grid.arms:  # a recipe error surfaces now, with the arm's name, not after hours of training
        _check_recipe(recipe_text(grid, arm), f"{where}: arm {arm.name!r}")
    return grid


def _check_eval_flags(flags: list[str], where: str) -> None:
    """The evaluation's own parser on the flags, so that a wrong one stops the grid now, not after training."""
    import contextlib
    import io

    from evaluation import evaluate

    message = io.StringIO()
    try:
        with contextlib.redirect_stderr(message):
            evaluate.parse_args(["base", *flags])
    except SystemExit:
        last = (message.getvalue().strip().splitlines() or ["not valid"])[-1]
        raise GridError(f"{where}: eval_flags {' '.join(flags)!r}: {last.split('error: ', 1)[-1]}") from None


def recipe_text(grid: Grid, arm: Arm) -> str:
    values = {**grid.recipe, **arm.recipe}
    return "".join(f"{key}={_recipe_value(value)}\n" for key, value in values.items())


def _recipe_value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _check_recipe(text: str, where: str) -> None:
    import tempfile

    from opsd.config import RecipeError, parse_recipe

    with tempfile.NamedTemporaryFile("w", suffix=".env", delete=False) as f:
        f.write(text)
    try:
        parse_recipe(f.name)
    except RecipeError as exc:
        raise GridError(f"{where}: {str(exc).replace(f.name, 'recipe')}") from None
    finally:
        os.unlink(f.name)


def cells(grid: Grid, out: Path) -> list[Cell]:
    found = []
    for arm in grid.arms:
        if not arm.train:
            found.append(Cell(arm, None, out / arm.name))
        else:
            found += [Cell(arm, seed, out / arm.name / f"seed-{seed}") for seed in grid.seeds]
    return found


# --------------------------------------------------------------------------
# Running one cell
# --------------------------------------------------------------------------

def train_command(grid: Grid, cell: Cell, processes: int = 1, port: int | None = None) -> list[str]:
    """The cell's training: one process, or `processes` DDP processes (one per GPU of the cell)
    through accelerate on `port`; either way the grid's global batch."""
    b = grid.budget
    accumulation = b["global_batch"] // (b["per_device_batch"] * processes)
    if processes == 1:
        command = [sys.executable, str(REPO / "opsd_train.py")]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch",
                   "--config_file", str(REPO / "configs" / "ddp.yaml"), "--num_processes", str(processes),
                   "--main_process_port", str(port or 29500), str(REPO / "opsd_train.py")]
    if grid.preset:
        command += ["--preset", grid.preset]
    command += [
        "--recipe", str(cell.folder / "recipe.env"), "--output_dir", str(cell.folder / "run"),
        "--seed", str(cell.seed), "--max_steps", str(b["max_steps"]),
        "--per_device_train_batch_size", str(b["per_device_batch"]),
        "--gradient_accumulation_steps", str(accumulation),
        "--save_strategy", "steps", "--save_steps", str(save_every(grid)), "--report_to", "none",
        "--logging_steps", "1", *cell.arm.flags,
    ]
    return command


def save_every(grid: Grid) -> int:
    """Checkpoint interval: the sweep's, else a quarter of the budget, so that an interrupted,
    preempted or timed-out cell resumes from at most a quarter back (resuming is exact)."""
    return grid.sweep_every or max(1, grid.budget["max_steps"] // 4)


def eval_command(grid: Grid, cell: Cell) -> list[str]:
    """The last checkpoint's evaluation, or with `sweep_every` every checkpoint's (the run folder)."""
    if cell.seed is None:
        checkpoint = "base"
    elif grid.sweep_every:
        checkpoint = str(cell.folder / "run")
    else:
        checkpoint = str(cell.folder / "run" / f"checkpoint-{grid.budget['max_steps']}")
    command = [sys.executable, "-m", "evaluation", checkpoint, "--output-dir", str(cell.folder / "eval")]
    if grid.preset:
        command += ["--preset", grid.preset]
    if grid.eval_data:
        command += ["--dataset", grid.eval_data]
    return command + list(grid.eval_flags)


def cell_identity(grid: Grid, cell: Cell) -> dict:
    """What a cell's results depend on, and nothing about where it ran: stored as the cell's
    cell.json, so that a grid folder never mixes the cells of two different grids."""
    identity = {"arm": cell.arm.name, "seed": cell.seed, "preset": grid.preset, "eval_data": grid.eval_data,
                "eval_flags": list(grid.eval_flags)}
    if cell.arm.train:
        identity.update(budget=grid.budget, sweep_every=grid.sweep_every, recipe={**grid.recipe, **cell.arm.recipe},
                        env=cell.arm.env, flags=list(cell.arm.flags))
    return identity


def check_cell_identity(grid: Grid, cell: Cell) -> None:
    """GridError when the cell's folder holds another grid's cell (its cell.json differs)."""
    path = cell.folder / "cell.json"
    if not path.is_file():
        return
    stored = json.loads(path.read_text(encoding="utf-8"))
    wanted = json.loads(json.dumps(cell_identity(grid, cell)))  # as JSON has it (tuples are lists)
    if stored != wanted:
        key = next(k for k in sorted(set(stored) | set(wanted)) if stored.get(k) != wanted.get(k))
        raise GridError(f"{cell.folder} holds the cell of another grid ({key}: {stored.get(key)!r} there, "
                        f"{wanted.get(key)!r} in this grid); use another --out, or delete that folder")


def devices_label(gpus: tuple[str, ...] | None) -> str:
    if gpus is None:
        return "this machine"
    return f"GPU {','.join(gpus)}" if gpus else "CPU"


def _ignore_usr2() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def run_cell(grid: Grid, cell: Cell, log, gpus: tuple[str, ...] | None = None, port: int | None = None,
             started=None) -> str:
    """Train (if needed) and evaluate one cell; returns 'done', 'skipped' or 'failed: ...'.

    gpus: the GPU ids the cell runs on (its CUDA_VISIBLE_DEVICES; () = CPU; None = whatever this
    process sees, as under SLURM, which sets it); several GPUs train as that many DDP processes on
    `port`. started(process) is told each child process, so that a SLURM job can stop it cleanly."""
    if cell.report.is_file():
        return "skipped"
    cell.folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(cell.folder / "cell.json", json.dumps(cell_identity(grid, cell), indent=1) + "\n")
    env = {**os.environ, **cell.arm.env, "PYTHONUNBUFFERED": "1"}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    steps = []
    if cell.arm.train:
        (cell.folder / "recipe.env").write_text(recipe_text(grid, cell.arm), encoding="utf-8")
        steps.append(("train", train_command(grid, cell, max(1, len(gpus or ())), port)))
    steps.append(("eval", eval_command(grid, cell)))
    for kind, command in steps:
        start = time.time()
        log(f"{cell.name}: {kind} on {devices_label(gpus)} ...")
        with open(cell.folder / f"{kind}.log", "a", encoding="utf-8") as out:
            where = f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} " if gpus is not None else ""
            start_line = "\n" if out.tell() else ""  # an interrupted run may have left a line unfinished
            out.write(f"{start_line}$ {where}{' '.join(command)}\n")
            out.flush()
            if started is None:
                status = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode
            else:
                # Under SLURM, SIGUSR2 is submitit's notice to the job (preemption, time limit): the
                # children ignore it and are stopped by SlurmCell.checkpoint with a SIGTERM instead.
                child = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                         preexec_fn=_ignore_usr2)
                started(child)
                while (status := child.poll()) is None:  # not wait(): the signal handler must be able to reap it
                    time.sleep(0.5)
        if status != 0:
            return f"failed: {kind} exited {status} (see {cell.folder / f'{kind}.log'})"
        log(f"{cell.name}: {kind} done in {time.time() - start:.0f} s")
    reports = sorted((cell.folder / "eval").glob("eval_*.json"))
    if cell.seed is not None and grid.sweep_every:  # the last checkpoint's report is the cell's
        reports = [r for r in reports if r.name.endswith(f"_checkpoint-{grid.budget['max_steps']}.json")]
        sweeps = sorted((cell.folder / "eval").glob("sweep_*.json"))
        if len(sweeps) != 1:
            return f"failed: expected one sweep table in {cell.folder / 'eval'}, found {len(sweeps)}"
        shutil.copyfile(sweeps[0], cell.folder / "sweep.json")
    if len(reports) != 1:
        return f"failed: expected one eval report in {cell.folder / 'eval'}, found {len(reports)}"
    tmp = cell.report.with_suffix(".json.tmp")
    shutil.copyfile(reports[0], tmp)
    os.replace(tmp, cell.report)  # the done marker appears only complete
    return "done"


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------

def results(grid: Grid, out: Path, all_cells: list[Cell]) -> dict:
    """analysis.stats summary per arm and compare of each arm against the baseline."""
    from analysis import stats as run_stats

    runs = {arm.name: [run_stats.load_run(c.report) for c in all_cells if c.arm is arm and c.report.is_file()]
            for arm in grid.arms}
    table = {"grid": {"eval_data": grid.eval_data, "preset": grid.preset, "seeds": list(grid.seeds),
                      "budget": grid.budget, "recipe": grid.recipe, "baseline": grid.baseline},
             "arms": {}}
    base_runs = runs[grid.baseline]
    for arm in grid.arms:
        arm_runs = runs[arm.name]
        entry = {"trained": arm.train, "recipe": arm.recipe, "env": arm.env, "flags": list(arm.flags),
                 "runs": len(arm_runs)}
        if arm_runs:
            summary = run_stats.summarize_runs(arm_runs, run_stats.check_comparable(arm_runs), 2000, 0)
            entry["per_run"] = [r["avg"] for r in summary["runs"]]
            entry["mean"] = sum(entry["per_run"]) / len(entry["per_run"])
            entry["metric"] = summary["metric"]
        if arm.name != grid.baseline and arm_runs and base_runs:
            counts = run_stats.check_comparable([*base_runs, *arm_runs])
            compare = run_stats.compare_arms(base_runs, arm_runs, counts, 2000, 0)
            entry["difference"] = compare["difference"]
            entry["ci"] = compare["bootstrap"]["ci"]
            entry["verdict"] = compare["verdict"]
        if grid.sweep_every and arm.train:
            entry["per_step"] = _mean_per_step([c for c in all_cells if c.arm is arm])
        entry.update(_sampled_tokens(grid, [c for c in all_cells if c.arm is arm and c.report.is_file()],
                                     entry.get("per_step")))
        table["arms"][arm.name] = entry
    table["missing"] = [c.name for c in all_cells if not c.report.is_file()]
    return table


def _mean_per_step(cells: list[Cell]) -> dict[str, float]:
    """{step: the mean over the arm's seeds of that checkpoint's accuracy}, from each cell's
    sweep.json (steps every finished seed has)."""
    per_seed = []
    for cell in cells:
        path = cell.folder / "sweep.json"
        if cell.report.is_file() and path.is_file():
            rows = json.loads(path.read_text(encoding="utf-8"))["checkpoints"]
            per_seed.append({row["step"]: row["avg"] for row in rows})
    if not per_seed:
        return {}
    steps = sorted(set.intersection(*(set(s) for s in per_seed)))
    return {str(step): sum(s[step] for s in per_seed) / len(per_seed) for step in steps}


def _sampled_tokens(grid: Grid, done: list[Cell], per_step: dict | None) -> dict:
    """An arm's sampled tokens (analysis.tokens): each finished seed's cumulative `tokens/sampled`
    at its last checkpoint (None: its run did not record it) and their mean (None unless every seed
    recorded it), and with a sweep the mean at each swept step; an untrained arm samples none."""
    from analysis import tokens as run_tokens

    if not done:
        return {}
    if not done[0].arm.train:
        return {"sampled_tokens": 0, "sampled_tokens_per_run": [0]}
    by_seed = []
    for cell in done:
        try:
            by_seed.append(run_tokens.read_sampled_tokens(cell.folder / "run"))
        except run_tokens.TokensError as exc:  # the results stand without this column
            print(f"warning: sampled tokens of {cell.name} not read: {exc}", file=sys.stderr)
            by_seed.append(None)
    last = [run_tokens.tokens_at(t, grid.budget["max_steps"]) for t in by_seed]
    entry = {"sampled_tokens": run_tokens.mean_or_none(last), "sampled_tokens_per_run": last}
    if per_step is not None:
        entry["per_step_sampled_tokens"] = {
            step: run_tokens.mean_or_none(run_tokens.tokens_at(t, int(step)) for t in by_seed) for step in per_step}
    return entry


def markdown(table: dict) -> str:
    g = table["grid"]
    metric = next((a["metric"] for a in table["arms"].values() if "metric" in a), "avg@k")
    lines = [f"Eval set `{g['eval_data'] or 'default'}`, {metric}; budget {g['budget']}; seeds {g['seeds']}; "
             f"baseline `{g['baseline']}`.", "",
             f"| arm | runs | {metric} per run | mean | sampled tokens | vs {g['baseline']} (95% CI) | verdict |",
             "|---|---|---|---|---|---|---|"]
    for name, a in table["arms"].items():
        per_run = ", ".join(f"{v:.2f}" for v in a.get("per_run", [])) or "-"
        mean = f"{a['mean']:.2f}" if "mean" in a else "-"
        diff = f"{a['difference']:+.2f} [{a['ci'][0]:+.2f}, {a['ci'][1]:+.2f}]" if "difference" in a else "-"
        verdict = a.get("verdict", "-").split(": ", 1)[-1]
        tokens = _tokens_cell(a)
        lines.append(f"| {name} | {a['runs']} | {per_run} | {mean} | {tokens} | {diff} | {verdict} |")
    swept = {name: a["per_step"] for name, a in table["arms"].items() if a.get("per_step")}
    if swept:
        steps = sorted({int(step) for per_step in swept.values() for step in per_step})
        lines += ["", f"{metric} per checkpoint, mean over each arm's seeds (`sweep.json` of each cell: "
                      "every checkpoint's table, best against last):", "",
                  "| step | " + " | ".join(swept) + " |", "|---|" + "---|" * len(swept)]
        for step in steps:
            cells = [f"{per_step[str(step)]:.2f}" if str(step) in per_step else "-" for per_step in swept.values()]
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
    if any("sampled_tokens" in a for a in table["arms"].values()):
        lines += ["", "sampled tokens: completion tokens the student sampled up to the last checkpoint "
                      "(`tokens/sampled` of each seed's metrics.jsonl), mean over the seeds; 0 for an arm trained "
                      "on reference solutions (SFT), - for the untrained arm, not recorded for runs that did not "
                      "log it. Accuracy against them: `python -m analysis.stats tokens GRID_DIR`."]
    if table.get("missing"):
        lines += ["", f"Missing cells (no results yet, not in the table): {', '.join(table['missing'])}; "
                      "re-run the same command to run them."]
    return "\n".join(lines) + "\n"


def _tokens_cell(arm: dict) -> str:
    from analysis.tokens import format_tokens

    if "sampled_tokens" not in arm or not arm.get("trained", True):
        return "-"  # no finished cell, or the untrained model
    return format_tokens(arm["sampled_tokens"])


def draw_curves(grid: Grid, out: Path) -> Path | None:
    """curves.png beside results.md, arms in the grid's order; None (one warning line) when it
    cannot be drawn: the grid's results stand without it."""
    from analysis import plots as run_plots

    arms = [arm.name for arm in grid.arms if arm.train]
    drawn = run_plots.draw_or_warn("grid curves", run_plots.overlay_grid, out, arms=arms)
    return None if drawn is None else out / run_plots.CURVES_FILE


def draw_accuracy_vs_tokens(grid: Grid, out: Path) -> Path | None:
    """With `sweep_every`: accuracy_vs_tokens.png beside results.md, each arm's accuracy against
    the tokens it sampled (analysis.plots.plot_accuracy_vs_tokens); None without a sweep, or
    (one warning line) when it cannot be drawn."""
    from analysis import plots as run_plots
    from analysis import stats as run_stats

    if not grid.sweep_every:
        return None
    path = out / run_plots.ACCURACY_VS_TOKENS_FILE
    drawn = run_plots.draw_or_warn("accuracy-vs-tokens plot",
                                   lambda: run_plots.plot_accuracy_vs_tokens(run_stats.grid_table(out), path))
    return None if drawn is None else path


# --------------------------------------------------------------------------
# Where the cells run
# --------------------------------------------------------------------------

def local_slots(grid: Grid, args) -> tuple[list[str], list[tuple[str, ...]]]:
    """This machine's GPUs and the pool's slots (none without GPUs or with --gpus-per-cell 0);
    ExecutorError for a request the machine cannot meet."""
    gpus = executors.visible_gpus()
    per_cell = 1 if args.gpus_per_cell is None else args.gpus_per_cell
    if not gpus and (args.gpus_per_cell or 0) > 0:
        raise executors.ExecutorError(f"--gpus-per-cell {args.gpus_per_cell}: this machine has no GPU visible")
    slots = executors.gpu_slots(gpus, per_cell, args.cells_per_gpu) if gpus else []
    if per_cell > 1:
        _check_processes_divide_batch(grid, per_cell)
    return gpus, slots


def run_here(grid: Grid, todo: list[Cell], args, gpus: list[str], slots: list, log) -> dict[str, str]:
    """The cells on this machine: each on its own GPU(s) from the pool, or `--parallel` at a time
    without GPUs. Returns {cell name: outcome}."""
    per_cell = 1 if args.gpus_per_cell is None else args.gpus_per_cell
    if slots:
        at_once = min(len(slots), args.parallel) if args.parallel else len(slots)
        log(f"GPU pool: {len(gpus)} GPU(s) {','.join(gpus)}, {per_cell} a cell, {args.cells_per_gpu} cell(s) a GPU: "
            f"{at_once} cell(s) at a time")
        if args.parallel and args.parallel > len(slots):
            log(f"--parallel {args.parallel} is more than the pool's {len(slots)} slot(s): raise --cells-per-gpu "
                "to run more cells on a GPU at once")
        outcomes = executors.run_pooled(todo, lambda cell, index, slot: run_cell(
            grid, cell, log, gpus=slot, port=29500 + index), slots, args.parallel)
    else:
        hidden = () if gpus else None  # --gpus-per-cell 0 on a GPU machine: the cells see no GPU
        log(f"{'CPU only (--gpus-per-cell 0)' if gpus else 'no GPU visible'}: {args.parallel or 1} cell(s) at a time")
        outcomes = executors.run_pooled(todo, lambda cell, _index, _slot: run_cell(grid, cell, log, gpus=hidden),
                                        [], args.parallel)
    return dict(zip((c.name for c in todo), outcomes))


def _check_processes_divide_batch(grid: Grid, processes: int) -> None:
    b = grid.budget
    if b["global_batch"] % (b["per_device_batch"] * processes):
        raise executors.ExecutorError(
            f"{processes} GPUs a cell: global_batch {b['global_batch']} is not a multiple of per_device_batch "
            f"{b['per_device_batch']} x {processes} processes")


class SlurmCell:
    """One cell as a SLURM job (submitit pickles this object and calls it on the node). When SLURM
    preempts the job or its time limit nears, submitit calls `checkpoint`: the training stops at a
    step boundary with a checkpoint (SIGTERM), and the requeued job resumes from it."""

    def __init__(self, grid_file: str, out: str, name: str, gpus_per_cell: int):
        self.grid_file, self.out, self.name, self.gpus_per_cell = grid_file, out, name, gpus_per_cell
        self._child = None

    def __getstate__(self):
        return {**self.__dict__, "_child": None}

    def __call__(self) -> str:
        grid = load_grid(self.grid_file)
        (cell,) = [c for c in cells(grid, Path(self.out)) if c.name == self.name]
        gpus = tuple(executors.visible_gpus()[:self.gpus_per_cell]) if self.gpus_per_cell else ()
        if len(gpus) < self.gpus_per_cell:
            raise RuntimeError(f"{self.name}: asked for {self.gpus_per_cell} GPU(s), the job sees {len(gpus)}")
        port = 20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000  # cells of one node must not share one
        outcome = run_cell(grid, cell, lambda message: print(message, flush=True), gpus=gpus, port=port,
                           started=self._started)
        if outcome.startswith("failed"):
            raise RuntimeError(f"{self.name}: {outcome}")
        return outcome

    def _started(self, child) -> None:
        self._child = child

    def checkpoint(self, *args, **kwargs):
        import submitit

        child = self._child
        if child is not None and child.poll() is None:
            print(f"{self.name}: stopping at a step boundary with a checkpoint before the requeue", flush=True)
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=CHECKPOINT_WAIT_S)
            except subprocess.TimeoutExpired:
                child.kill()
        return submitit.helpers.DelayedSubmission(SlurmCell(self.grid_file, self.out, self.name, self.gpus_per_cell))


CHECKPOINT_WAIT_S = 100  # a capped step and a checkpoint save, well inside the signal's 120 s lead


def run_on_slurm(grid: Grid, grid_file: str, todo: list[Cell], out: Path, args, log) -> dict[str, str] | None:
    """Submit the cells not already queued as one job array; unless --no-wait, wait with progress
    and resubmit once each cell that failed. Returns {cell name: outcome}, or None (--no-wait)."""
    options = executors.SlurmOptions(
        partition=args.partition, time_min=args.time,
        gpus_per_cell=1 if args.gpus_per_cell is None else args.gpus_per_cell,
        cpus_per_cell=args.cpus_per_cell, mem_gb=args.mem_per_cell, account=args.account, qos=args.qos,
        sbatch=executors.parse_sbatch_options(args.sbatch), array_parallelism=args.parallel)
    copy = out / "grid.json"  # what the jobs read: the grid as submitted, whatever happens to GRID.json
    write_text_atomic(copy, Path(grid_file).read_text(encoding="utf-8"))
    jobs_file = out / "slurm_jobs.json"  # cell -> its last job id: a re-run waits for queued ones
    jobs = json.loads(jobs_file.read_text(encoding="utf-8")) if jobs_file.is_file() else {}
    watch = executors.SlurmWatch()
    queued = watch.queued([jobs[c.name] for c in todo if c.name in jobs])
    waiting = {c.name: jobs[c.name] for c in todo if jobs.get(c.name) in queued}
    if waiting:
        log(f"{len(waiting)} cell(s) still queued from an earlier submission: {', '.join(sorted(waiting))}")
    executor = executors.slurm_executor(out / "slurm", options, f"grid-{out.name}")

    def submit(names: list[str]) -> None:
        if not names:
            return
        try:
            with executor.batch():
                handles = {name: executor.submit(SlurmCell(str(copy), str(out), name, options.gpus_per_cell))
                           for name in names}
        except Exception as exc:  # submitit's FailedJobError, or sbatch missing: sbatch's own last word
            said = [line.strip() for line in str(exc).splitlines() if line.strip()]
            raise executors.ExecutorError(f"sbatch refused the job array: {said[-1] if said else exc}") from None
        for name, job in handles.items():
            jobs[name] = job.job_id
        write_text_atomic(jobs_file, json.dumps(jobs, indent=1) + "\n")
        kind = "job array" if len(names) > 1 else "job"
        log(f"submitted {len(names)} cell(s) as {kind} {next(iter(handles.values())).job_id.split('_')[0]}: "
            + ", ".join(f"{name} {handles[name].job_id}" for name in names))

    submit([c.name for c in todo if c.name not in waiting])
    if args.no_wait:
        log(f"not waiting (--no-wait): re-run the same command to collect the results and resubmit failed cells; "
            f"logs under {out / 'slurm'}")
        return None
    outcomes: dict[str, str] = {}
    tries = {name: 1 for name in jobs}
    pending = {c.name for c in todo}
    last = None
    failures = 0
    while pending:
        try:
            queued = watch.queued([jobs[name] for name in pending])
            failures = 0
        except (executors.ExecutorError, OSError, subprocess.SubprocessError) as exc:
            failures += 1  # a busy controller times out now and then: keep waiting, up to a point
            if failures >= SQUEUE_FAILURES:
                raise executors.ExecutorError(f"squeue failed {failures} times in a row: {exc}") from None
            log(f"squeue failed ({exc}); asking again in {args.poll:.0f} s")
            time.sleep(args.poll)
            continue
        for name in sorted(pending):
            if jobs[name] in queued:
                continue
            cell = next(c for c in todo if c.name == name)
            if cell.report.is_file():
                outcomes[name] = "done"
                log(f"{name}: done (job {jobs[name]})")
            elif _job_cancelled(out, jobs[name]):  # scancel: the user's word, not a failure to retry
                outcomes[name] = f"failed: cancelled ({_job_failure(out, jobs[name])}); re-run the grid to resubmit it"
            elif tries[name] < 2:
                log(f"{name}: job {jobs[name]} ended without results ({_job_failure(out, jobs[name])}); resubmitting "
                    "it once: it resumes from its last checkpoint")
                tries[name] += 1
                submit([name])
                continue
            else:
                outcomes[name] = f"failed twice: {_job_failure(out, jobs[name])}"
            pending.discard(name)
        states = sorted(queued.values())
        summary = ", ".join(f"{states.count(s)} {s.lower()}" for s in sorted(set(states)))
        line = f"slurm: {len(outcomes)} of {len(todo)} cell(s) ended" + (f"; {summary}" if summary else "")
        if line != last:
            log(line)
            last = line
        if pending:
            time.sleep(args.poll)
    return outcomes


SQUEUE_FAILURES = 10  # consecutive failed queue reads before the wait gives up


def _job_log(out: Path, job_id: str) -> Path:
    """A job's error log, where submitit's sbatch script sends it (an array task's id is 'A_T')."""
    return out / "slurm" / job_id / f"{job_id}_0_log.err"


def _job_cancelled(out: Path, job_id: str) -> bool:
    """Whether scancel (or an admin) ended the job: SLURM's last 'CANCELLED AT' line in its error
    log gives no other cause ('DUE TO JOB REQUEUE', 'DUE TO TIME LIMIT', ... are not cancels)."""
    log_path = _job_log(out, job_id)
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    lines = [line for line in text.splitlines() if "CANCELLED AT" in line]
    return bool(lines) and "DUE TO" not in lines[-1]


def _job_failure(out: Path, job_id: str) -> str:
    """What a job left about its end, with its log's path: the cell's own failure line (it names the
    cell's train.log or eval.log) when it got that far, else the log's last line (killed, ...)."""
    log_path = _job_log(out, job_id)
    lines = [line.strip() for line in (log_path.read_text(errors="replace").splitlines() if log_path.is_file() else [])
             if line.strip()]
    ours = [line.split(": ", 2)[-1] for line in lines if line.startswith("RuntimeError: ")]
    return f"{(ours or lines or ['no error log'])[-1][:300]}; log {log_path}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.grid", description=__doc__.split("\n\n")[0])
    parser.add_argument("grid", help="grid file (JSON)")
    parser.add_argument("--out", required=True, help="grid folder: one sub-folder per cell, results at the top")
    parser.add_argument("--cluster", choices=("local", "slurm"), default="local",
                        help="where the cells run: this machine (default) or a SLURM cluster (one job array, "
                             "through submitit)")
    parser.add_argument("--parallel", type=int, default=None,
                        help="at most this many cells at once (local, default: one per GPU slot, 1 without GPUs; "
                             "slurm: the job array's limit, default none)")
    parser.add_argument("--gpus-per-cell", type=int, default=None,
                        help="GPUs a cell trains on (default 1; 0 = CPU); several = that many DDP processes")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    here = parser.add_argument_group("this machine (--cluster local)")
    here.add_argument("--cells-per-gpu", type=int, default=None,
                      help="cells sharing one GPU (default 1; small models: several)")
    slurm = parser.add_argument_group("SLURM (--cluster slurm)")
    slurm.add_argument("--partition", help="sbatch --partition")
    slurm.add_argument("--time", type=int, default=None, help="a cell's time limit in minutes (default 240); "
                       "a cell that reaches it checkpoints, is requeued and resumes")
    slurm.add_argument("--cpus-per-cell", type=int, default=None, help="sbatch --cpus-per-task")
    slurm.add_argument("--mem-per-cell", type=float, default=None, metavar="GB", help="sbatch --mem, in GB")
    slurm.add_argument("--account", help="sbatch --account")
    slurm.add_argument("--qos", help="sbatch --qos")
    slurm.add_argument("--sbatch", action="append", default=[], metavar="NAME=VALUE",
                       help="any other sbatch option, e.g. --sbatch constraint=h100 (repeatable)")
    slurm.add_argument("--no-wait", action="store_true",
                       help="submit and return; re-running the same command collects and resubmits failed cells")
    slurm.add_argument("--poll", type=float, default=30, metavar="S", help="seconds between queue checks (30)")
    args = parser.parse_args(argv)
    from opsd.config import ConfigError, check_env

    try:
        check_env()  # the cells inherit this environment: a misspelled OPSD_* name stops the grid, not each cell
        _check_executor_options(args)
        grid = load_grid(args.grid)
        out = Path(args.out).resolve()
        all_cells = cells(grid, out)
        for cell in all_cells:
            check_cell_identity(grid, cell)
        if args.cluster == "local":
            gpus, slots = local_slots(grid, args)
        elif not args.dry_run:
            executors.check_slurm_tools()
            if (args.gpus_per_cell or 1) > 1:
                _check_processes_divide_batch(grid, args.gpus_per_cell)
    except (GridError, ConfigError, executors.ExecutorError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        for cell in all_cells:
            if cell.arm.train:
                print(" ".join(train_command(grid, cell)))
            print(" ".join(eval_command(grid, cell)))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()

    def log(message: str) -> None:
        print(f"[grid {time.time() - start:6.0f} s] {message}", flush=True)

    todo = [c for c in all_cells if not c.report.is_file()]
    log(f"{len(all_cells)} cells, {len(all_cells) - len(todo)} already done, {len(todo)} to run"
        + (" on SLURM" if args.cluster == "slurm" else ""))
    try:
        if args.cluster == "slurm":
            outcomes = run_on_slurm(grid, args.grid, todo, out, args, log)
            if outcomes is None:
                return 0
        else:
            outcomes = run_here(grid, todo, args, gpus, slots, log)
    except executors.ExecutorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = {name: outcome for name, outcome in outcomes.items() if outcome.startswith("failed")}
    for name, outcome in failed.items():
        log(f"{name}: {outcome}")
    table = results(grid, out, all_cells)
    write_text_atomic(out / "results.json", json.dumps(table, indent=1) + "\n")
    write_text_atomic(out / "results.md", markdown(table))
    print(markdown(table), end="")
    curves = draw_curves(grid, out)
    tokens_plot = draw_accuracy_vs_tokens(grid, out)
    log(f"results: {out / 'results.md'}" + (f"; curves: {curves}" if curves else "")
        + (f"; accuracy against sampled tokens: {tokens_plot}" if tokens_plot else ""))
    print("\n".join(["", *final_lines(all_cells, table)]))
    return 1 if failed else 0


def final_lines(cells: list[Cell], table: dict) -> list[str]:
    """The grid's last lines: each evaluated cell's FINAL line (from its report, the one the
    table compares), then each arm's verdict against the baseline; what quickstart.sh ends with."""
    from evaluation.metrics import final_line

    lines = []
    for cell in cells:
        if cell.report.is_file():
            m = json.loads(cell.report.read_text(encoding="utf-8"))["metrics"]
            lines.append(f"{cell.name}: {final_line(m['num_correct'], m['num_samples'], m['num_problems'], m['k'])}")
    baseline = table["grid"]["baseline"]
    return lines + [f"{name} vs {baseline}: {arm['verdict']}" for name, arm in table["arms"].items()
                    if "verdict" in arm]


def _check_executor_options(args) -> None:
    """Each option belongs to one executor: one given to the other is an error, not ignored."""
    slurm_only = {"partition": None, "time": None, "cpus_per_cell": None, "mem_per_cell": None, "account": None,
                  "qos": None, "sbatch": [], "no_wait": False, "poll": 30}
    if args.cluster == "local":
        given = [name for name, default in slurm_only.items() if getattr(args, name) != default]
        if given:
            raise executors.ExecutorError(f"--{given[0].replace('_', '-')} is a SLURM option: add --cluster slurm")
        args.cells_per_gpu = 1 if args.cells_per_gpu is None else args.cells_per_gpu
    else:
        if args.cells_per_gpu is not None:
            raise executors.ExecutorError("--cells-per-gpu is for this machine's GPU pool; on SLURM each cell is "
                                          "a job with --gpus-per-cell GPUs")
        args.time = 240 if args.time is None else args.time
        executors.parse_sbatch_options(args.sbatch)  # a malformed one stops here, before anything is written
        if args.time < 1 or (args.poll <= 0):
            raise executors.ExecutorError(f"--time must be >= 1 minute and --poll > 0, got {args.time} and {args.poll}")
    if args.parallel is not None and args.parallel < 1:
        raise executors.ExecutorError(f"--parallel must be >= 1, got {args.parallel}")
    if args.gpus_per_cell is not None and args.gpus_per_cell < 0:
        raise executors.ExecutorError(f"--gpus-per-cell must be >= 0, got {args.gpus_per_cell}")
    if args.cells_per_gpu is not None and args.cells_per_gpu < 1:
        raise executors.ExecutorError(f"--cells-per-gpu must be >= 1, got {args.cells_per_gpu}")


if __name__ == "__main__":
    sys.exit(main())
