"""Ablation grid: arms x seeds -> train -> evaluate -> compare each arm with the baseline
(opsd.analysis.stats); the grid file's format: docs/RESEARCH.md, "Ablation grids".

    python -m opsd.research.grid GRID.json --out runs/my-grid [--parallel 4] [--dry-run] [--results-only]
    python -m opsd.research.grid status runs/my-grid    # each cell: done / running where / pending / failed / cancelled
    python -m opsd.research.grid cancel runs/my-grid    # scancel a SLURM grid's jobs; they stay cancelled

A grid file (JSON) names the arms and what they share:

    {
      "preset": "tiny",                       # optional: the embedded default
      "eval_data": "tiny:31337:100",          # one eval set for every cell
      "eval_flags": ["--backend", "vllm"],    # optional: more flags of opsd.evaluation for every cell
      "sweep_every": 25,                      # optional: checkpoints every 25 steps, each evaluated
      "seeds": [0, 1, 2],                     # training seeds, paired across arms
      "budget": {"max_steps": 100, "global_batch": 32, "per_device_batch": 32},
      "base_recipe": "shipped",               # arms start from recipe.env (default) or "released"
      "recipe": {"learning_rate": 1e-4},      # recipe keys every trained arm gets, on top of it
      "baseline": "base",                     # the arm every other arm is compared with
      "compare_to": ["token"],                # optional: arms every arm is also compared with (results)
      "margin": 3,                            # optional: equivalence margin in pass@1 points, stated now
      "arms": {
        "base": {"train": false},             # the untrained model, evaluated once
        "shipped": {},
        "constant": {"recipe": {"lr_scheduler_type": "constant"}},
        "token": {"env": {"OPSD_CLIP_MODE": "token"}},
        "sft": {"flags": ["--loss_type", "sft"]}
      }
    }

Each cell (arm, seed) is `opsd_train.py` with the arm's recipe, `OPSD_*`
variables and extra trainer flags, then `python -m opsd.evaluation` on its last checkpoint.
Seed s is the same training seed in every arm (same data order, same initial
rollout RNG), so arms are compared on paired seeds. A cell whose `eval.json`
exists is skipped; a cell with a partial run resumes from its last checkpoint,
so re-running the same command after an interruption finishes the grid. At the
end: `results.md` (one table, the verdict of `opsd.analysis.stats` compare of each arm
against the baseline; a second with pass@1, pass@n, maj@n and distinct answers a problem against
it, and one against the `compare_to` arms: opsd/research/grid_metrics.py) and `results.json`
(every number) in the grid folder, and
`curves.png` beside them: each trained arm's training curves, the mean over its
seeds with the lowest-to-highest band (`python -m opsd.analysis.plots overlay --grid`), and
`passk.png`: each arm's pass@k against k (`python -m opsd.analysis.plots passk`). Each arm's
sampled tokens (the mean over its seeds of `tokens/sampled` at the last checkpoint, opsd.analysis.tokens)
stand next to its accuracy, and each cell's wall time (timing.json) below the table. The output
ends with each evaluated cell's FINAL line and each arm's verdict against the baseline (what
quickstart.sh shows).

With `sweep_every: N`, trained cells save a checkpoint every N steps and evaluate every one
(`python -m opsd.evaluation RUN_FOLDER`, opsd/evaluation/sweep.py: one report per checkpoint, the cell's
`sweep.json` with accuracy against step, best against last); the arms' table still compares
the last checkpoints, and `results.md` / `results.json` add each arm's mean accuracy per step
(`results.json` also its mean sampled tokens per step), and `accuracy_vs_tokens.png` draws each
arm's accuracy against the tokens it sampled (`python -m opsd.analysis.stats tokens GRID_DIR`: the table),
and `steps.png` its pass@1 and pass@n per checkpoint (`python -m opsd.analysis.plots steps`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from opsd.research import executors
from opsd.research.cell import (  # noqa: F401  (re-exported: the grid module is what notes and tests name)
    BASE_RECIPES,
    BUDGET_DEFAULT,
    EVAL_PAGED_GIB,
    PROGRESS_EVERY_S,
    REPO,
    TIMING_FILE,
    Arm,
    Cell,
    Grid,
    GridError,
    _check_processes_divide_batch,
    base_recipe_keys,
    cell_identity,
    cells,
    check_cell_code,
    check_cell_identity,
    code_version,
    eval_command,
    load_grid,
    recipe_text,
    run_cell,
    save_every,
    snapshot_code,
    train_command,
)
from opsd.research.slurm_grid import COMMANDS, _job_cancelled, run_on_slurm  # noqa: F401
from opsd.research.slurm_grid import command as folder_command
from opsd.run_folder import RunFolderError, flock, write_text_atomic

# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------

def results(grid: Grid, out: Path, all_cells: list[Cell]) -> dict:
    """opsd.analysis.stats summary per arm and compare of each arm against the baseline, on pass@1
    and on the metrics of opsd.research.grid_metrics (pass@n, maj@n, distinct answers; swept
    checkpoints; the collapse watch; the `compare_to` arms; equivalence with the grid's `margin`)."""
    from opsd.analysis import stats as run_stats
    from opsd.research import grid_metrics

    runs = {arm.name: [run_stats.load_run(c.report) for c in all_cells if c.arm is arm and c.report.is_file()]
            for arm in grid.arms}
    table = {"grid": {"eval_data": grid.eval_data, "preset": grid.preset, "seeds": list(grid.seeds),
                      "budget": grid.budget, "base_recipe": grid.base_recipe,
                      "base_recipe_file": BASE_RECIPES[grid.base_recipe], "base_recipe_keys": base_recipe_keys(grid),
                      "recipe": grid.recipe, "baseline": grid.baseline, "margin": grid.margin,
                      "compare_to": list(grid.compare_to)},
             "arms": {}}
    base_runs = runs[grid.baseline]
    for arm in grid.arms:
        arm_runs = runs[arm.name]
        entry = {"trained": arm.train, "recipe": arm.recipe, "env": arm.env, "flags": list(arm.flags),
                 "runs": len(arm_runs)}
        if arm_runs:
            summary = run_stats.summarize_runs(arm_runs, run_stats.check_comparable(arm_runs),
                                               run_stats.DEFAULT_BOOTSTRAP, 0)
            entry["per_run"] = [r["avg"] for r in summary["runs"]]
            entry["mean"] = sum(entry["per_run"]) / len(entry["per_run"])
            entry["metric"] = summary["metric"]
            entry["metrics"] = grid_metrics.arm_metrics(arm_runs)
        if arm.name != grid.baseline and arm_runs and base_runs:
            # opsd.analysis.stats compare's numbers and words (its resample count and seed): the same
            # interval as `python -m opsd.analysis.stats compare --a BASELINE --b ARM` prints.
            versus = grid_metrics.comparison(grid.baseline, base_runs, arm.name, arm_runs, grid.margin)
            kept = ("difference", "ci", "verdict", "verdict_sentence", "statistics", "verdict_words", "disagreement",
                    "equivalence")
            entry.update({key: versus[key] for key in kept if key in versus})
            for name, numbers in versus["metrics"].items():
                entry["metrics"][name].update(numbers)
        arm_cells = [c for c in all_cells if c.arm is arm]
        if grid.sweep_every and arm.train:
            entry["per_step"] = _mean_per_step(arm_cells)
            entry.update(grid_metrics.sweep_entry(arm_cells))
        if arm.train:
            entry["collapse_warning"] = grid_metrics.collapse_steps([c for c in arm_cells if c.report.is_file()])
        entry.update(_sampled_tokens(grid, [c for c in all_cells if c.arm is arm and c.report.is_file()],
                                     entry.get("per_step")))
        entry.update(_wall_time([c for c in all_cells if c.arm is arm and c.report.is_file()]))
        table["arms"][arm.name] = entry
    table["compare_to"] = {
        ref: {arm.name: grid_metrics.comparison(ref, runs[ref], arm.name, runs[arm.name], grid.margin)
              for arm in grid.arms if arm.name not in (ref, grid.baseline) and runs[arm.name]}  # the baseline's
        # row would be the main table's row of `ref`, its sign flipped
        for ref in grid.compare_to if runs[ref]}
    table["missing"] = [c.name for c in all_cells if not c.report.is_file()]
    table["bootstrap_resamples"] = run_stats.DEFAULT_BOOTSTRAP
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
    """An arm's sampled tokens (opsd.analysis.tokens): each finished seed's cumulative `tokens/sampled`
    at its last checkpoint (None: its run did not record it) and their mean (None unless every seed
    recorded it), and with a sweep the mean at each swept step; an untrained arm samples none.
    Its compute likewise: `forward_tokens` / `backward_tokens` (and per run), the cumulative
    `tokens/forward` / `tokens/backward` at the last checkpoint."""
    from opsd.analysis import tokens as run_tokens

    if not done:
        return {}
    if not done[0].arm.train:
        return {"sampled_tokens": 0, "sampled_tokens_per_run": [0], "forward_tokens": 0, "backward_tokens": 0}
    by_seed, passes = [], []
    for cell in done:
        try:
            sampled, forward_backward = (run_tokens.read_sampled_tokens(cell.folder / "run"),
                                         run_tokens.read_pass_tokens(cell.folder / "run"))
        except run_tokens.TokensError as exc:  # the results stand without these columns
            print(f"warning: sampled tokens of {cell.name} not read: {exc}", file=sys.stderr)
            sampled, forward_backward = None, (None, None)
        by_seed.append(sampled)
        passes.append(forward_backward)
    last = [run_tokens.tokens_at(t, grid.budget["max_steps"]) for t in by_seed]
    entry = {"sampled_tokens": run_tokens.mean_or_none(last), "sampled_tokens_per_run": last}
    for i, name in enumerate(("forward_tokens", "backward_tokens")):
        per_run = [run_tokens.tokens_at(p[i], grid.budget["max_steps"]) for p in passes]
        entry.update({name: run_tokens.mean_or_none(per_run), f"{name}_per_run": per_run})
    if per_step is not None:
        entry["per_step_sampled_tokens"] = {
            step: run_tokens.mean_or_none(run_tokens.tokens_at(t, int(step)) for t in by_seed) for step in per_step}
    return entry


def _wall_time(done: list[Cell]) -> dict:
    """An arm's `wall_time` entry (a key of its own: like provenance, it says how a result was made,
    not what it is, and differs between two runs of the same cells) from its finished cells'
    timing.json (opsd.research.cell.record_time): per run
    the seconds of training and of evaluation (None: not recorded), their means over the runs that
    recorded them, whether any step was resumed (its time then covers only its last part) and the
    most cells the grid let share a GPU with one of them (None: unknown, e.g. no GPU pool)."""
    timings = []
    for cell in done:
        try:
            timing = json.loads((cell.folder / TIMING_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            timing = None
        timings.append(timing if isinstance(timing, dict) else {})
    if not any(timings):
        return {}
    entry = {}
    for kind in ("train", "eval"):
        per_run = [t.get(f"{kind}_s") for t in timings]
        known = [v for v in per_run if isinstance(v, (int, float))]
        entry[f"{kind}_s_per_run"] = per_run
        entry[f"{kind}_s"] = sum(known) / len(known) if known else None
    entry["wall_resumed"] = any(t.get("train_resumed") or t.get("eval_resumed") for t in timings)
    sharing = [t.get("cells_per_gpu") for t in timings if isinstance(t.get("cells_per_gpu"), int)]
    entry["cells_per_gpu"] = max(sharing) if sharing else None
    return {"wall_time": entry}


def _wall_lines(table: dict) -> list[str]:
    """results.md's wall-time table (arms with timing.json), with what the times are a cost of."""
    timed = {name: {**a["wall_time"], "trained": a.get("trained", True)}
             for name, a in table["arms"].items() if "wall_time" in a}
    if not timed:
        return []

    def seconds(values) -> str:
        return ", ".join("-" if v is None else f"{v:.0f}" for v in values) or "-"

    lines = ["", "Wall time a cell, in seconds (`timing.json` of each cell: each step's process from start to "
                 "end, loading and checkpoints included):", "",
             "| arm | training per run | evaluation per run | mean training + evaluation | cells a GPU |",
             "|---|---|---|---|---|"]
    for name, a in timed.items():
        parts = [a[k] for k in ("train_s", "eval_s") if a[k] is not None]
        total = f"{sum(parts):.0f}" + (" (resumed: a part)" if a["wall_resumed"] else "") if parts else "-"
        training = seconds(a["train_s_per_run"]) if a["trained"] else "-"
        sharing = "-" if a["cells_per_gpu"] is None else str(a["cells_per_gpu"])
        lines.append(f"| {name} | {training} | {seconds(a['eval_s_per_run'])} | {total} | {sharing} |")
    shared = sorted({a["cells_per_gpu"] for a in timed.values() if (a["cells_per_gpu"] or 1) > 1})
    if shared:
        lines += ["", f"Cells shared a GPU (up to {shared[-1]} a GPU, `--cells-per-gpu`): these times rank the "
                      "arms under that sharing; they are not the cost of a run on a dedicated GPU."]
    elif any(a["cells_per_gpu"] == 1 for a in timed.values()):
        lines += ["", "One cell a GPU (`--cells-per-gpu 1`): the cost of a run with the GPU to itself (the "
                      "machine's CPUs shared with the grid's other cells, if any ran at once)."]
    return lines


def markdown(table: dict) -> str:
    from opsd.research import grid_metrics

    g = table["grid"]
    metric = next((a["metric"] for a in table["arms"].values() if "metric" in a), "avg@k")
    margin = (f" Equivalence margin {g['margin']:g} points on pass@1, stated in the grid file before the run "
              "(TOST beside each difference test)." if g.get("margin") is not None else "")
    lines = [f"Eval set `{g['eval_data'] or 'default'}`, {metric}; budget {g['budget']}; seeds {g['seeds']}; "
             f"baseline `{g['baseline']}`.{margin}", "", _recipe_line(g), "",
             f"| arm | runs | {metric} per run | mean | sampled tokens | forward + backward tokens "
             f"| vs {g['baseline']} (95% CI) | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for name, a in table["arms"].items():
        per_run = ", ".join(f"{v:.2f}" for v in a.get("per_run", [])) or "-"
        mean = f"{a['mean']:.2f}" if "mean" in a else "-"
        diff = f"{a['difference']:+.2f} [{a['ci'][0]:+.2f}, {a['ci'][1]:+.2f}]" if "difference" in a else "-"
        verdict = a.get("verdict_words", a.get("verdict_sentence", "-"))  # its numbers are the CI column
        tokens = _tokens_cell(a)
        lines.append(f"| {name} | {a['runs']} | {per_run} | {mean} | {tokens} | {_compute_cell(a)} | {diff} "
                     f"| {verdict} |")
    lines += grid_metrics.metrics_lines(table)
    swept = {name: a["per_step"] for name, a in table["arms"].items() if a.get("per_step")}
    if swept:
        steps = sorted({int(step) for per_step in swept.values() for step in per_step})
        lines += ["", f"{metric} per checkpoint, mean over each arm's seeds (`sweep.json` of each cell: "
                      "every checkpoint's table, best against last):", "",
                  "| step | " + " | ".join(swept) + " |", "|---|" + "---|" * len(swept)]
        for step in steps:
            cells = [f"{per_step[str(step)]:.2f}" if str(step) in per_step else "-" for per_step in swept.values()]
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += grid_metrics.sweep_lines(table) + grid_metrics.collapse_lines(table)
    lines += _wall_lines(table)
    if any("sampled_tokens" in a for a in table["arms"].values()):
        lines += ["", "sampled tokens: completion tokens the student sampled up to the last checkpoint "
                      "(`tokens/sampled` of each seed's metrics.jsonl), mean over the seeds; 0 for an arm trained "
                      "on reference solutions (SFT), - for the untrained arm, not recorded for runs that did not "
                      "log it. Accuracy against them: `python -m opsd.analysis.stats tokens GRID_DIR`. Forward + "
                      "backward tokens: the compute of training up to the last checkpoint (`tokens/forward`, "
                      "`tokens/backward`, mean over the seeds): real tokens through the training forwards "
                      "(the student's prompt + completion, and the teacher's privileged prompt + completion for "
                      "OPSD and SFT, the reference's for GRPO with --grpo_beta) and through the backward (the "
                      "student's); rollouts not included."]
    if any("verdict" in a for a in table["arms"].values()):
        from opsd.analysis.stats import CHECKPOINTS_VS_ARMS

        lines += ["", f"95% CI: paired bootstrap of `python -m opsd.analysis.stats compare` "
                      f"({table.get('bootstrap_resamples', '?')} resamples, seed 0). Verdicts: {CHECKPOINTS_VS_ARMS}."]
    if table.get("missing"):
        lines += ["", f"Missing cells (no results yet, not in the table): {', '.join(table['missing'])}; "
                      "run the grid's command (without --results-only) to run them."]
    return "\n".join(lines) + "\n"


def _recipe_line(g: dict) -> str:
    """Which recipe the trained arms started from (results of grids from before base recipes: the
    released one, the only one a cell got then)."""
    name = g.get("base_recipe", "released")
    keys = g.get("base_recipe_keys", {})
    changes = ", ".join(f"{k}={v}" for k, v in keys.items()) or "no key changed"
    on_top = ", ".join(f"{k}={v}" for k, v in g.get("recipe", {}).items())
    file = g.get("base_recipe_file", BASE_RECIPES[name])
    return (f"Trained arms start from the {name} recipe (`{file}`: {changes})"
            + (f", then the grid's recipe keys ({on_top})" if on_top else "")
            + ", then their own (arm rows' `recipe`).")


def _compute_cell(arm: dict) -> str:
    from opsd.analysis.tokens import format_tokens

    if "forward_tokens" not in arm or not arm.get("trained", True):
        return "-"
    forward, backward = arm["forward_tokens"], arm["backward_tokens"]
    if forward is None or backward is None:
        return format_tokens(None)  # not recorded
    return f"{format_tokens(forward)} + {format_tokens(backward)}"


def _tokens_cell(arm: dict) -> str:
    from opsd.analysis.tokens import format_tokens

    if "sampled_tokens" not in arm or not arm.get("trained", True):
        return "-"  # no finished cell, or the untrained model
    return format_tokens(arm["sampled_tokens"])


def draw_curves(grid: Grid, out: Path) -> Path | None:
    """curves.png beside results.md, arms in the grid's order; None (one warning line) when it
    cannot be drawn: the grid's results stand without it."""
    from opsd.analysis import plots as run_plots

    arms = [arm.name for arm in grid.arms if arm.train]
    drawn = run_plots.draw_or_warn("grid curves", run_plots.overlay_grid, out, arms=arms)
    return None if drawn is None else out / run_plots.CURVES_FILE


def draw_accuracy_vs_tokens(grid: Grid, out: Path) -> Path | None:
    """With `sweep_every`: accuracy_vs_tokens.png beside results.md, each arm's accuracy against
    the tokens it sampled (opsd.analysis.plots.plot_accuracy_vs_tokens); None without a sweep, or
    (one warning line) when it cannot be drawn."""
    from opsd.analysis import plots as run_plots
    from opsd.analysis import stats as run_stats

    if not grid.sweep_every:
        return None
    path = out / run_plots.ACCURACY_VS_TOKENS_FILE
    drawn = run_plots.draw_or_warn("accuracy-vs-tokens plot",
                                   lambda: run_plots.plot_accuracy_vs_tokens(run_stats.grid_table(out), path))
    return None if drawn is None else path


def draw_passk(grid: Grid, out: Path) -> Path | None:
    """passk.png beside results.md: pass@k against k per evaluated arm (its seeds' eval.json), in
    the grid's order; None (one warning line) when it cannot be drawn."""
    from opsd.analysis import plots as run_plots

    arms = [arm.name for arm in grid.arms]
    drawn = run_plots.draw_or_warn("pass@k plot", run_plots.plot_grid_passk, out, arms=arms)
    return None if drawn is None else out / run_plots.PASSK_FILE


def draw_steps(grid: Grid, out: Path) -> Path | None:
    """With `sweep_every`: steps.png beside results.md, each arm's pass@1 and pass@n per swept
    checkpoint; None without a sweep, or (one warning line) when it cannot be drawn."""
    from opsd.analysis import plots as run_plots

    if not grid.sweep_every:
        return None
    drawn = run_plots.draw_or_warn("pass@k over steps plot", run_plots.plot_steps, out,
                                   arms=[arm.name for arm in grid.arms])
    return None if drawn is None else out / run_plots.STEPS_FILE


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


def run_here(grid: Grid, todo: list[Cell], args, gpus: list[str], slots: list, log,
             code: str | None = None, code_dir: Path = REPO) -> dict[str, str]:
    """The cells on this machine: each on its own GPU(s) from the pool, or `--parallel` at a time
    without GPUs. Returns {cell name: outcome}; a cell whose run raises is that cell's failure (its
    traceback in the cell's error.log), not the grid's end."""
    per_cell = 1 if args.gpus_per_cell is None else args.gpus_per_cell
    progress = getattr(args, "progress_every", None) or PROGRESS_EVERY_S

    def one(cell: Cell, gpus_of_cell) -> str:
        try:
            return run_cell(grid, cell, log, gpus=gpus_of_cell, code=code, code_dir=code_dir, progress_every=progress,
                            cells_per_gpu=args.cells_per_gpu if slots else None)
        except Exception as exc:  # noqa: BLE001  (one cell's bug must not cost the other cells' table)
            import traceback

            cell.folder.mkdir(parents=True, exist_ok=True)
            (cell.folder / "error.log").write_text(traceback.format_exc(), encoding="utf-8")
            return f"failed: {type(exc).__name__}: {exc} (traceback in {cell.folder / 'error.log'})"

    if slots:
        at_once = min(len(slots), args.parallel) if args.parallel else len(slots)
        log(f"GPU pool: {len(gpus)} GPU(s) {','.join(gpus)}, {per_cell} a cell, {args.cells_per_gpu} cell(s) a GPU: "
            f"{at_once} cell(s) at a time")
        if args.parallel and args.parallel > len(slots):
            log(f"--parallel {args.parallel} is more than the pool's {len(slots)} slot(s): raise --cells-per-gpu "
                "to run more cells on a GPU at once")
        outcomes = executors.run_pooled(todo, lambda cell, _index, slot: one(cell, slot), slots, args.parallel)
    else:
        hidden = () if gpus else None  # --gpus-per-cell 0 on a GPU machine: the cells see no GPU
        log(f"{'CPU only (--gpus-per-cell 0)' if gpus else 'no GPU visible'}: {args.parallel or 1} cell(s) at a time")
        outcomes = executors.run_pooled(todo, lambda cell, _index, _slot: one(cell, hidden), [], args.parallel)
    return dict(zip((c.name for c in todo), outcomes, strict=True))


def main(argv=None, prog: str = "python -m opsd.research.grid") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:  # `status DIR` / `cancel DIR`; else the first argument is the grid file
        return folder_command(argv, prog)
    # The subcommands take a grid folder instead of a grid file (folder_command); listed here so that
    # --help shows them.
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s GRID --out DIR [options]\n"
                                           "       %(prog)s status DIR\n       %(prog)s cancel DIR",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=(
                                         f"subcommands ({prog} SUBCOMMAND DIR; {prog} SUBCOMMAND --help):\n"
                                         "  status DIR  each cell of a grid folder: done, running where (its step), "
                                         "pending, failed (its log), cancelled\n"
                                         "  cancel DIR  stop a SLURM grid's jobs; they stay cancelled until a re-run "
                                         "with --resubmit-cancelled"))
    parser.add_argument("grid", help="grid file (JSON)")
    parser.add_argument("--out", required=True, help="grid folder: one sub-folder per cell, results at the top")
    parser.add_argument("--cluster", choices=("local", "slurm"), default="local",
                        help="where the cells run: this machine (default) or a SLURM cluster (one job array, "
                             "through submitit)")
    parser.add_argument("--parallel", type=int, default=None,
                        help="at most this many cells at once (local, default: one per GPU slot, 1 without GPUs; "
                             "slurm: cells queued or running at once, across all the grid's jobs, default no limit)")
    parser.add_argument("--gpus-per-cell", type=int, default=None,
                        help="GPUs a cell trains on (default 1; 0 = CPU); several = that many DDP processes")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--results-only", action="store_true",
                        help="table the cells that have finished (results.md / .json, figures) and run none: a copy "
                             "of a grid still running elsewhere, or cells brought back from another machine")
    parser.add_argument("--allow-code-change", action="store_true",
                        help="resume cells that started on another version of the code (recorded in each cell.json); "
                             "without it such a cell stops the grid")
    parser.add_argument("--progress-every", type=float, default=PROGRESS_EVERY_S, metavar="S",
                        help=f"seconds between a running cell's progress lines (default {PROGRESS_EVERY_S:.0f})")
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
    slurm.add_argument("--cells-per-node", type=int, default=None, metavar="N",
                       help="N cells a job, side by side on one node's GPUs (the job asks for N x --gpus-per-cell "
                            "GPUs and runs the pool there); default 1: a job a cell")
    slurm.add_argument("--resubmit-cancelled", action="store_true",
                       help="submit again the cells whose jobs were cancelled (`cancel`, scancel); without it a "
                            "re-run reports them cancelled")
    slurm.add_argument("--retry-failed", action="store_true",
                       help="submit again the cells that failed twice (slurm_tries.json counts the failures across "
                            "re-runs); without it a re-run reports them failed")
    args = parser.parse_args(argv)
    from opsd.config import ConfigError, check_env

    try:
        check_env()  # the cells inherit this environment: a misspelled OPSD_* name stops the grid, not each cell
        _check_executor_options(args)
        grid = load_grid(args.grid)
        out = Path(args.out).resolve()
        all_cells = cells(grid, out)
        if args.cluster == "local":
            gpus, slots = local_slots(grid, args)
            processes = max(1, 1 if args.gpus_per_cell is None else args.gpus_per_cell) if slots else 1
        else:
            processes = max(1, 1 if args.gpus_per_cell is None else args.gpus_per_cell)
        code = code_version()
        for cell in all_cells:
            check_cell_identity(grid, cell, processes)
            if not args.results_only:  # nothing resumes: a started cell's code version is not mixed
                check_cell_code(cell, code, args.allow_code_change)
        if args.cluster == "slurm" and not (args.dry_run or args.results_only):
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
    try:
        lock = GridLock(out)
    except GridError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with lock:
        return _run_grid(grid, all_cells, out, args, code, gpus if args.cluster == "local" else [],
                         slots if args.cluster == "local" else [])


def _run_grid(grid: Grid, all_cells: list[Cell], out: Path, args, code: str | None, gpus: list[str],
              slots: list) -> int:
    start = time.time()

    def log(message: str) -> None:
        print(f"[grid {time.time() - start:6.0f} s] {message}", flush=True)

    todo = [c for c in all_cells if not c.report.is_file()]
    log(f"{len(all_cells)} cells, {len(all_cells) - len(todo)} already done, {len(todo)} to run"
        + (" on SLURM" if args.cluster == "slurm" else ""))
    if args.results_only and todo:
        log(f"--results-only: the {len(todo)} unfinished cell(s) stay as they are; the table holds the finished ones")
        todo = []
    code, code_dir = snapshot_code(out) if todo else (code, REPO)
    if todo and code is not None:
        log(f"the cells run the code as it is now ({code}), copied to {code_dir}: editing the checkout from "
            "here on changes none of them")
    try:
        if args.results_only:
            outcomes = {}
        elif args.cluster == "slurm":
            outcomes = run_on_slurm(grid, args.grid, todo, out, args, log, code=code, code_dir=code_dir)
            if outcomes is None:
                return 0
        else:
            outcomes = run_here(grid, todo, args, gpus, slots, log, code=code, code_dir=code_dir)
    except executors.ExecutorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = {name: outcome for name, outcome in outcomes.items() if outcome.startswith(("failed", "cancelled"))}
    for name, outcome in failed.items():
        log(f"{name}: {outcome}")
    from opsd.analysis.reports import InputError  # numpy: only once there is a table to make

    try:
        table = results(grid, out, all_cells)
    except InputError as exc:  # a finished cell's report or sweep.json that cannot be read
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    write_text_atomic(out / "results.json", json.dumps(table, indent=1) + "\n")
    write_text_atomic(out / "results.md", markdown(table))
    print(markdown(table), end="")
    figures = {"curves": draw_curves(grid, out), "pass@k": draw_passk(grid, out),
               "accuracy against sampled tokens": draw_accuracy_vs_tokens(grid, out),
               "pass@1 and pass@n over steps": draw_steps(grid, out)}
    log(f"results: {out / 'results.md'}" + "".join(f"; {what}: {path}" for what, path in figures.items() if path))
    print("\n".join(["", *final_lines(all_cells, table)]))
    return 1 if failed else 0


class GridLock:
    """`.grid.lock` in the grid folder, held (flock) by the one grid process that runs or waits for
    its cells: a second `opsd.research.grid` on the same --out is refused with one line. The flock,
    not the file, is the lock: the kernel drops it when its process ends, however it ends, so a
    killed grid's leftover file stops no one; a grid that ends (normally or on an error) removes the
    file. A filesystem without file locks is one line (opsd.run_folder.flock)."""

    def __init__(self, out: Path):
        import os
        import socket

        self.path = out / ".grid.lock"
        while True:
            self._file = open(self.path, "a+", encoding="utf-8")
            try:
                flock(self._file, str(self.path), wait=False)
            except BlockingIOError:
                self._file.seek(0)
                holder = self._file.read().strip() or "another process"
                self._file.close()
                raise GridError(f"another grid is running into {out} ({holder}); wait for it to end, or use another "
                                "--out (`python -m opsd.research.grid status` shows its cells)") from None
            except RunFolderError as exc:
                self._file.close()
                raise GridError(str(exc).replace("put the folder", "put --out", 1)) from None
            try:  # the file locked is still the one at the path: not one an ending grid removed meanwhile
                if os.stat(self.path).st_ino == os.fstat(self._file.fileno()).st_ino:
                    break
            except FileNotFoundError:
                pass
            self._file.close()
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"PID {os.getpid()} on {socket.gethostname()}\n")
        self._file.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)  # while still locked: a grid starting now locks a new file
        self._file.close()  # closing drops the flock


def final_lines(cells: list[Cell], table: dict) -> list[str]:
    """The grid's last lines: each evaluated cell's FINAL line (from its report, the one the
    table compares), then each arm's verdict against the baseline (its sentence, then its numbers),
    what quickstart.sh ends with; first, when there are verdicts, what their two claims mean."""
    from opsd.analysis.stats import CHECKPOINTS_VS_ARMS
    from opsd.evaluation.metrics import final_line

    lines = [f"how to read the verdicts below: {CHECKPOINTS_VS_ARMS}"] if any(
        "verdict" in arm for arm in table["arms"].values()) else []
    for cell in cells:
        if cell.report.is_file():
            m = json.loads(cell.report.read_text(encoding="utf-8"))["metrics"]
            lines.append(f"{cell.name}: {final_line(m['num_correct'], m['num_samples'], m['num_problems'], m['k'])}")
    baseline = table["grid"]["baseline"]
    lines += [f"{name} vs {baseline}: {arm['verdict']}" for name, arm in table["arms"].items() if "verdict" in arm]
    return lines + [f"{name} vs {ref}: {row['verdict']}" for ref, rows in (table.get("compare_to") or {}).items()
                    for name, row in rows.items()]


def _check_executor_options(args) -> None:
    """Each option belongs to one executor: one given to the other is an error, not ignored."""
    slurm_only = {"partition": None, "time": None, "cpus_per_cell": None, "mem_per_cell": None, "account": None,
                  "qos": None, "sbatch": [], "no_wait": False, "poll": 30, "resubmit_cancelled": False,
                  "cells_per_node": None, "retry_failed": False}
    if args.cluster == "local":
        given = [name for name, default in slurm_only.items() if getattr(args, name) != default]
        if given:
            raise executors.ExecutorError(f"--{given[0].replace('_', '-')} is a SLURM option: add --cluster slurm")
        args.cells_per_gpu = 1 if args.cells_per_gpu is None else args.cells_per_gpu
    else:
        if args.cells_per_gpu is not None:
            raise executors.ExecutorError("--cells-per-gpu is for this machine's GPU pool; on SLURM each cell is "
                                          "a job with --gpus-per-cell GPUs (--cells-per-node N: N cells a job)")
        args.time = 240 if args.time is None else args.time
        executors.parse_sbatch_options(args.sbatch)  # a malformed one stops here, before anything is written
        if args.time < 1 or (args.poll <= 0):
            raise executors.ExecutorError(f"--time must be >= 1 minute and --poll > 0, got {args.time} and {args.poll}")
    if args.parallel is not None and args.parallel < 1:
        raise executors.ExecutorError(f"--parallel must be >= 1, got {args.parallel}")
    if args.gpus_per_cell is not None and args.gpus_per_cell < 0:
        raise executors.ExecutorError(f"--gpus-per-cell must be >= 0, got {args.gpus_per_cell}")
    if getattr(args, "cells_per_node", None) is not None and args.cells_per_node < 1:
        raise executors.ExecutorError(f"--cells-per-node must be >= 1, got {args.cells_per_node}")
    if args.cells_per_gpu is not None and args.cells_per_gpu < 1:
        raise executors.ExecutorError(f"--cells-per-gpu must be >= 1, got {args.cells_per_gpu}")


if __name__ == "__main__":
    sys.exit(main())
