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
seeds with the lowest-to-highest band (`python -m analysis.plots overlay --grid`).

With `sweep_every: N`, trained cells save a checkpoint every N steps and evaluate every one
(`python -m evaluation RUN_FOLDER`, evaluation/sweep.py: one report per checkpoint, the cell's
`sweep.json` with accuracy against step, best against last); the arms' table still compares
the last checkpoints, and `results.md` / `results.json` add each arm's mean accuracy per step.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from opsd.run_folder import write_text_atomic

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

    from evaluation import evaluate as opsd_eval

    message = io.StringIO()
    try:
        with contextlib.redirect_stderr(message):
            opsd_eval.parse_args(["base", *flags])
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

def train_command(grid: Grid, cell: Cell) -> list[str]:
    b = grid.budget
    accumulation = b["global_batch"] // b["per_device_batch"]
    command = [sys.executable, str(REPO / "opsd_train.py")]
    if grid.preset:
        command += ["--preset", grid.preset]
    command += [
        "--recipe", str(cell.folder / "recipe.env"), "--output_dir", str(cell.folder / "run"),
        "--seed", str(cell.seed), "--max_steps", str(b["max_steps"]),
        "--per_device_train_batch_size", str(b["per_device_batch"]),
        "--gradient_accumulation_steps", str(accumulation),
        "--save_strategy", "steps", "--save_steps", str(grid.sweep_every or b["max_steps"]), "--report_to", "none",
        "--logging_steps", "1", *cell.arm.flags,
    ]
    return command


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


def run_cell(grid: Grid, cell: Cell, log) -> str:
    """Train (if needed) and evaluate one cell; returns 'done', 'skipped' or 'failed: ...'."""
    if cell.report.is_file():
        return "skipped"
    cell.folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **cell.arm.env, "PYTHONUNBUFFERED": "1"}
    steps = []
    if cell.arm.train:
        (cell.folder / "recipe.env").write_text(recipe_text(grid, cell.arm), encoding="utf-8")
        steps.append(("train", train_command(grid, cell)))
    steps.append(("eval", eval_command(grid, cell)))
    for kind, command in steps:
        start = time.time()
        log(f"{cell.name}: {kind} ...")
        with open(cell.folder / f"{kind}.log", "a", encoding="utf-8") as out:
            out.write(f"$ {' '.join(command)}\n")
            out.flush()
            status = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode
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
        entry = {"recipe": arm.recipe, "env": arm.env, "flags": list(arm.flags), "runs": len(arm_runs)}
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
        table["arms"][arm.name] = entry
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


def markdown(table: dict) -> str:
    g = table["grid"]
    metric = next((a["metric"] for a in table["arms"].values() if "metric" in a), "avg@k")
    lines = [f"Eval set `{g['eval_data'] or 'default'}`, {metric}; budget {g['budget']}; seeds {g['seeds']}; "
             f"baseline `{g['baseline']}`.", "",
             f"| arm | runs | {metric} per run | mean | vs {g['baseline']} (95% CI) | verdict |",
             "|---|---|---|---|---|---|"]
    for name, a in table["arms"].items():
        per_run = ", ".join(f"{v:.2f}" for v in a.get("per_run", [])) or "-"
        mean = f"{a['mean']:.2f}" if "mean" in a else "-"
        diff = f"{a['difference']:+.2f} [{a['ci'][0]:+.2f}, {a['ci'][1]:+.2f}]" if "difference" in a else "-"
        verdict = a.get("verdict", "-").split(": ", 1)[-1]
        lines.append(f"| {name} | {a['runs']} | {per_run} | {mean} | {diff} | {verdict} |")
    swept = {name: a["per_step"] for name, a in table["arms"].items() if a.get("per_step")}
    if swept:
        steps = sorted({int(step) for per_step in swept.values() for step in per_step})
        lines += ["", f"{metric} per checkpoint, mean over each arm's seeds (`sweep.json` of each cell: "
                      "every checkpoint's table, best against last):", "",
                  "| step | " + " | ".join(swept) + " |", "|---|" + "---|" * len(swept)]
        for step in steps:
            cells = [f"{per_step[str(step)]:.2f}" if str(step) in per_step else "-" for per_step in swept.values()]
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def draw_curves(grid: Grid, out: Path) -> Path | None:
    """curves.png beside results.md, arms in the grid's order; None (one warning line) when it
    cannot be drawn: the grid's results stand without it."""
    from analysis import plots as run_plots

    arms = [arm.name for arm in grid.arms if arm.train]
    drawn = run_plots.draw_or_warn("grid curves", run_plots.overlay_grid, out, arms=arms)
    return None if drawn is None else out / run_plots.CURVES_FILE


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.grid", description=__doc__.split("\n\n")[0])
    parser.add_argument("grid", help="grid file (JSON)")
    parser.add_argument("--out", required=True, help="grid folder: one sub-folder per cell, results at the top")
    parser.add_argument("--parallel", type=int, default=1, help="cells run at once (default 1)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    from opsd.config import ConfigError, check_env

    try:
        check_env()  # the cells inherit this environment: a misspelled OPSD_* name stops the grid, not each cell
        if args.parallel < 1:
            raise GridError(f"--parallel must be >= 1, got {args.parallel}")
        grid = load_grid(args.grid)
    except (GridError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    all_cells = cells(grid, out)
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
    log(f"{len(all_cells)} cells, {len(all_cells) - len(todo)} already done, {len(todo)} to run "
        f"({args.parallel} at a time)")
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        outcomes = dict(zip((c.name for c in todo), pool.map(lambda c: run_cell(grid, c, log), todo)))
    failed = {name: outcome for name, outcome in outcomes.items() if outcome.startswith("failed")}
    for name, outcome in failed.items():
        log(f"{name}: {outcome}")
    table = results(grid, out, all_cells)
    write_text_atomic(out / "results.json", json.dumps(table, indent=1) + "\n")
    write_text_atomic(out / "results.md", markdown(table))
    print(markdown(table), end="")
    curves = draw_curves(grid, out)
    log(f"results: {out / 'results.md'}" + (f"; curves: {curves}" if curves else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
