"""Plots (PNG): one run's training curves, several runs overlaid, arms with their intervals,
a grid's results.json against tokens, data or a setting. The command line lives here; the
figures live in modules by subject, re-exported here (every caller imports this module):
plot_curves (a run's curves), plot_overlays (runs and a grid's arms overlaid), plot_intervals
(intervals, a run's checkpoint sweep), plot_results (accuracy against tokens, data or a
setting), plot_passk (pass@k against k, pass@1 and pass@n over steps), plot_common (what they
share).

    python -m opsd.analysis.plots curves RUN_DIR [--metric KEY ...] [--out FILE.png]
    python -m opsd.analysis.plots overlay RUN_DIR [RUN_DIR ...] [--metric KEY ...] --out FILE.png
    python -m opsd.analysis.plots overlay --grid GRID_DIR [--metric KEY ...] [--out FILE.png]
    python -m opsd.analysis.plots results RESULTS.json [--x FIELD] [--group REGEX] [--out FILE.png]
    python -m opsd.analysis.plots passk GRID_DIR [--out FILE.png]
    python -m opsd.analysis.plots passk --arm NAME REPORT.json [REPORT.json ...] [--arm ...] --out FILE.png
    python -m opsd.analysis.plots steps GRID_DIR [--out FILE.png]

`curves` draws what a run folder's `metrics.jsonl` holds, one panel per quantity (loss,
true KL, divergence before the clip, clip shares, teacher mass removed, entropies,
completion lengths, truncated completions, learning rate, gradient norm; a quantity the run
did not log is left out, and so is a series that carries no information for this run: all 0,
constant, or a repeat of one drawn before it, named in the figure's footer with its value;
plot_curves states the tolerances). Each panel has a one-line note of what a healthy run looks
like. Default output: `RUN_DIR/curves.png`, which `opsd_train.py` also draws at the end of
every run. `overlay` draws one panel per metric with one line per run folder or, with
`--grid`, one line per arm of a opsd.research.grid folder: the mean over the arm's seeds, with
a band from the lowest to the highest seed at each step where an arm has several (default output
`GRID_DIR/curves.png`, which `opsd/research/grid.py` also draws); there, a first panel gives each
arm's accuracy (the grid's results.json: the mean, each seed's run, and the 95% interval of its
difference to the baseline, drawn from the baseline's mean), and without `--metric` a curve all 0
or constant in every arm (teacher mass removed at 0 under the token clip) is left out; the title
says what is drawn. A metric is a `metrics.jsonl` key
(`opsd/true_kl`) or its `[OPSD kl]` label (`true_kl`). `python -m opsd.analysis.stats ... --plot FILE.png`
draws its arms with the intervals it prints, through `plot_intervals`; `plot_sweep` draws a
run's accuracy per checkpoint (`dev_eval.sh RUN_FOLDER`, opsd/evaluation/sweep.py);
`plot_accuracy_vs_tokens` a grid's accuracy against the tokens its arms sampled
(`accuracy_vs_tokens.png`, which a grid with `sweep_every` draws; `python -m opsd.analysis.stats
tokens GRID_DIR --plot FILE.png` by hand).

`results` needs only a grid's results.json (opsd/research/grid.py writes it; grids/results/
keeps copies whose run folders are gone): each evaluated arm at its mean x and mean accuracy,
each seed's run as a small dot at its own x (`sampled_tokens_per_run`, ...) and accuracy
(`per_run`), the untrained arm (base) as a dotted line. `--x`: `sampled_tokens` (default),
`forward_tokens` (training compute), `unique_problems` (N of the arm's `--dataset_name
tiny:SEED:N`, log scale) or `learning_rate` (the arm's recipe, else the grid's; log scale).
Arms that `--group REGEX` puts together are one line (default: each arm its own labelled dot
for tokens, the name's prefix, opsd_n64 -> opsd, otherwise). Default output: beside the JSON,
NAME_X.png.

`passk` draws pass@k against k (k = 1..n, log2 axis) from evaluation reports, each arm's mean
over its runs as a line, each seed's run faint: a grid folder's arms (ARM/seed-N/eval.json, the
untrained arm's ARM/eval.json dotted; default output `GRID_DIR/passk.png`, which a grid also
draws), or the reports named with `--arm NAME REPORT.json ...` (repeat per arm). The numbers are
each report's `metrics` pass@1..pass@n; all reports must be of one eval set with one n. `steps`
draws a swept grid's (`sweep_every`) pass@1 and pass@n at each checkpoint, each arm's mean over
its seeds with each seed faint and the untrained arm dotted (each cell's sweep.json and the
reports it lists; default output `GRID_DIR/steps.png`, which such a grid also draws).

Bad input (a missing folder or file, an unreadable `metrics.jsonl` line, a metric that no
run logged, an --x that no arm of a results.json has, an output that is not a writable .png
path) is one `error: ...` line on stderr with exit status 2, and no PNG is written (figures
are written to a temporary file and renamed into place). matplotlib is imported only when a
figure is drawn, and only its Agg canvas is used (no pyplot): nothing opens a window, no global
backend is switched, and modules that import this one for its constants do not pay for
matplotlib.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

# Re-exported: callers and tests name them through this module.
from opsd.analysis.plot_common import (  # noqa: F401
    DPI,
    PlotError,
    check_output,
    draw_or_warn,
    run_name,
)
from opsd.analysis.plot_curves import (  # noqa: F401
    CURVE_PANELS,
    CURVES_FILE,
    KEY_TO_LABEL,
    LABEL_TO_KEY,
    Y_LABELS,
    metric_key,
    metric_label,
    panel_title,
    plot_run_curves,
    read_metrics,
    series,
    y_label,
)
from opsd.analysis.plot_intervals import Interval, IntervalPanel, plot_intervals, plot_sweep  # noqa: F401
from opsd.analysis.plot_overlays import (  # noqa: F401
    OVERLAY_METRICS,
    AccuracyPanel,
    ArmAccuracy,
    Curve,
    curve_colors,
    grid_accuracy,
    grid_arms,
    grid_curves,
    informative,
    overlay_grid,
    overlay_runs,
    plot_overlay,
    run_curves,
)
from opsd.analysis.plot_passk import (  # noqa: F401
    PASSK_FILE,
    STEPS_FILE,
    PassFigure,
    StepsFigure,
    grid_reports,
    pass_figure,
    passk_figure,
    plot_grid_passk,
    plot_passk,
    plot_steps,
    read_pass_at_k,
    steps_data,
    steps_figure,
)
from opsd.analysis.plot_results import (  # noqa: F401
    ACCURACY_VS_TOKENS_FILE,
    DEFAULT_GROUP,
    RESULTS_X,
    TOKEN_X,
    ResultsFigure,
    ResultsPoint,
    accuracy_vs_tokens_figure,
    plot_accuracy_vs_tokens,
    plot_results,
    read_results,
    recipe_value,
    results_figure,
    results_name,
    results_points,
    unique_problems,
)

# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None, prog: str = "python -m opsd.analysis.plots") -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog,
                                     description="PNG plots of training runs (metrics.jsonl), of a grid's "
                                                 "results.json, and of evaluation reports (pass@k).")
    commands = parser.add_subparsers(dest="command", required=True)
    metric = argparse.ArgumentParser(add_help=False)
    metric.add_argument("--metric", action="append", metavar="KEY",
                        help="a metrics.jsonl key (opsd/true_kl) or [OPSD kl] label (true_kl); repeat for "
                             "several panels")
    curves = commands.add_parser("curves", parents=[metric], help="one run's curves")
    curves.add_argument("run", metavar="RUN_DIR", help="a run folder (holding metrics.jsonl)")
    curves.add_argument("--out", metavar="FILE.png", help=f"default RUN_DIR/{CURVES_FILE}")
    overlay = commands.add_parser("overlay", parents=[metric], help="several runs, or the arms of a grid, overlaid")
    overlay.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run folders (holding metrics.jsonl)")
    overlay.add_argument("--grid", metavar="GRID_DIR", help="a opsd.research.grid folder: one line per arm (seed mean "
                                                            "and range) instead of RUN_DIRs")
    overlay.add_argument("--out", metavar="FILE.png", help=f"required with RUN_DIRs; default GRID_DIR/{CURVES_FILE}")
    results = commands.add_parser("results", help="a grid's arms from its results.json alone: accuracy against "
                                                  "tokens, unique problems or learning rate")
    results.add_argument("results", metavar="RESULTS.json", help="the results.json of a opsd.research.grid (or a "
                                                                 "copy in grids/results/)")
    results.add_argument("--x", choices=list(RESULTS_X), default="sampled_tokens",
                         help="where each arm is placed (default sampled_tokens)")
    results.add_argument("--group", metavar="REGEX",
                         help="arms whose names it matches alike (its capture groups joined by _, or the match) "
                              f"are one line; default: none for tokens, {DEFAULT_GROUP!r} (the name's prefix) "
                              "otherwise")
    results.add_argument("--out", metavar="FILE.png", help="default: beside RESULTS.json, NAME_X.png")
    passk = commands.add_parser("passk", help="pass@k against k (log2 axis) per arm, from evaluation reports: "
                                              "a grid's arms, or reports named per arm")
    passk.add_argument("grid", nargs="?", metavar="GRID_DIR", help="a opsd.research.grid folder: its evaluated arms")
    passk.add_argument("--arm", nargs="+", action="append", metavar=("NAME", "REPORT.json"),
                       help="instead of GRID_DIR: an arm's name, then its eval reports (one per seed); repeat per "
                            "arm")
    passk.add_argument("--out", metavar="FILE.png", help=f"required with --arm; default GRID_DIR/{PASSK_FILE}")
    steps = commands.add_parser("steps", help="a swept grid's pass@1 and pass@n over its checkpoints, per arm")
    steps.add_argument("grid", metavar="GRID_DIR", help="a opsd.research.grid folder with sweep_every")
    steps.add_argument("--out", metavar="FILE.png", help=f"default GRID_DIR/{STEPS_FILE}")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, prog: str = "python -m opsd.analysis.plots") -> int:
    args = parse_args(argv, prog)
    commands = {"results": _results, "curves": _curves, "overlay": _overlay, "passk": _passk, "steps": _steps}
    try:
        out, drawn = commands[args.command](args)
    except PlotError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"{out}: {len(drawn)} series")
    return 0


def _results(args) -> tuple[Path, list]:
    return plot_results(args.results, args.x, args.out, args.group)


def _curves(args) -> tuple[Path, list]:
    return args.out or Path(args.run) / CURVES_FILE, plot_run_curves(args.run, args.out, args.metric)


def _overlay(args) -> tuple[Path, list]:
    if args.grid:
        if args.runs:
            raise PlotError("give either RUN_DIRs or --grid, not both")
        return args.out or Path(args.grid) / CURVES_FILE, overlay_grid(args.grid, args.out, args.metric)
    if not args.runs:
        raise PlotError("overlay needs RUN_DIRs or --grid GRID_DIR")
    if not args.out:
        raise PlotError("overlay of RUN_DIRs needs --out FILE.png")
    return args.out, overlay_runs(args.runs, args.out, args.metric)


def _passk(args) -> tuple[Path, list]:
    if not args.arm:
        if not args.grid:
            raise PlotError("passk needs GRID_DIR or --arm NAME REPORT.json ...")
        return args.out or Path(args.grid) / PASSK_FILE, plot_grid_passk(args.grid, args.out)
    if args.grid:
        raise PlotError("give either GRID_DIR or --arm, not both")
    if not args.out:
        raise PlotError("passk of --arm reports needs --out FILE.png")
    check_output(args.out)
    arms: dict[str, list] = {}
    for name, *reports in args.arm:
        if not reports:
            raise PlotError(f"--arm {name}: no report (--arm NAME REPORT.json [REPORT.json ...])")
        if name in arms:
            raise PlotError(f"--arm {name}: given twice")
        arms[name] = [(Path(report).name, Path(report)) for report in reports]
    return args.out, plot_passk(pass_figure(arms), args.out)


def _steps(args) -> tuple[Path, list]:
    return args.out or Path(args.grid) / STEPS_FILE, plot_steps(args.grid, args.out)


if __name__ == "__main__":
    from opsd.cli import exit_status  # a reader that stops early (| head) ends it quietly

    sys.exit(exit_status(main))
