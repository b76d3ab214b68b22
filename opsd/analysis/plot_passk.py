"""What training costs in diversity, from evaluation reports: pass@k against k per arm
(passk.png, `python -m opsd.analysis.plots passk`), and a swept grid's pass@1 and pass@n over
its checkpoints (steps.png, `python -m opsd.analysis.plots steps`).

The numbers are the reports' own: each report's `metrics` holds pass@1..pass@n (the unbiased
estimator over its n samples per problem, opsd/evaluation/metrics.py); nothing is re-estimated.
An arm's line is the mean over its runs (seeds) of those numbers; each run is drawn faint.
"""
from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from opsd.analysis import plot_common as common
from opsd.analysis import reports
from opsd.analysis.plot_common import DPI, PlotError, check_output, read_json, seed_number, step_axis

PASSK_FILE = "passk.png"  # beside results.md of every grid
STEPS_FILE = "steps.png"  # beside results.md of a grid with sweep_every
REPORT = "an evaluation report of opsd.evaluation"


@dataclass(frozen=True)
class PassRun:
    """One evaluation report: pass@1..pass@n in percent (`values[k - 1]` is pass@k)."""
    label: str
    path: str
    values: tuple[float, ...]


@dataclass(frozen=True)
class PassArm:
    """An arm's runs (its seeds', or the untrained model's one report)."""
    arm: str
    runs: tuple[PassRun, ...]
    trained: bool = True

    @property
    def mean(self) -> tuple[float, ...]:
        """pass@k for each k, the mean over the arm's runs."""
        return tuple(sum(column) / len(column) for column in zip(*(r.values for r in self.runs), strict=True))


@dataclass(frozen=True)
class PassFigure:
    """All that `passk_figure` draws."""
    name: str  # the grid's folder name, or "" for reports named on the command line
    dataset: str
    n: int  # samples per problem: k runs 1..n
    arms: tuple[PassArm, ...]


def read_pass_at_k(path) -> tuple[str, int, tuple[float, ...]]:
    """(eval set, n, (pass@1, ..., pass@n)) of one report; a report without them is a PlotError
    naming the file and the missing key."""
    report = read_json(path, REPORT)
    metrics = report.get("metrics") if isinstance(report, dict) else None
    n = metrics.get("k") if isinstance(metrics, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise PlotError(f"{path}: no 'metrics' with its sample count 'k' (not {REPORT})")
    values = []
    for k in range(1, n + 1):
        value = metrics.get(f"pass@{k}")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise PlotError(f"{path}: metrics has no number 'pass@{k}' (k = {n}: pass@1..pass@{n} expected)")
        values.append(float(value))
    return str(report.get("dataset", "?")), n, tuple(values)


class OneEvalSet:
    """Reads reports' pass@k, checking that they are of one eval set and one n: curves of other
    sets or sample counts do not compare (a PlotError names the two files that differ)."""

    def __init__(self):
        self.first: tuple[str, int, str] | None = None  # (eval set, n, path) of the first report

    def read(self, path) -> tuple[float, ...]:
        dataset, n, values = read_pass_at_k(path)
        if self.first is None:
            self.first = (dataset, n, str(path))
        elif (dataset, n) != self.first[:2]:
            raise PlotError(f"{path}: {dataset} with n = {n}, but {self.first[2]}: {self.first[0]} with "
                            f"n = {self.first[1]}; pass@k compares reports of one eval set and one n")
        return values


def pass_figure(arms: dict[str, list[tuple[str, Path]]], name: str = "",
                untrained: Sequence[str] = ()) -> PassFigure:
    """The PassFigure of {arm: [(run label, report path), ...]} (`untrained`: arms drawn dotted)."""
    reports = OneEvalSet()
    built = tuple(PassArm(arm, tuple(PassRun(label, str(path), reports.read(path)) for label, path in runs),
                          arm not in untrained)
                  for arm, runs in arms.items())
    if reports.first is None:
        raise PlotError("no evaluation report given")
    return PassFigure(name, reports.first[0], reports.first[1], built)


def grid_reports(grid_dir, arms: Sequence[str] | None = None) -> tuple[dict[str, list[tuple[str, Path]]], list[str]]:
    """({arm: [(seed label, its eval.json)]}, the untrained arms) of a opsd.research.grid folder:
    a trained arm's finished cells ARM/seed-N/eval.json, an untrained arm's ARM/eval.json. Arms in
    the order given, else results.json's, else by name; an arm without a report is left out."""
    grid = Path(grid_dir)
    if not grid.is_dir():
        raise PlotError(f"{grid_dir}: no such folder")
    found, untrained = {}, []
    for name in arms if arms is not None else _arm_order(grid):
        cells = sorted((grid / name).glob("seed-*/eval.json"), key=lambda p: seed_number(p.parent))
        if cells:
            found[name] = [(f"seed {seed_number(p.parent)}", p) for p in cells]
        elif (grid / name / "eval.json").is_file():
            found[name] = [("untrained", grid / name / "eval.json")]
            untrained.append(name)
    if not found:
        raise PlotError(f"{grid_dir}: no ARM/eval.json or ARM/seed-N/eval.json in it (not a opsd.research.grid "
                        "folder, or no cell has been evaluated yet)")
    return found, untrained


def _arm_order(grid: Path) -> list[str]:
    """The grid's arms as its results.json lists them (the grid file's order), else by name."""
    try:
        return list(read_json(grid / "results.json", "")["arms"])
    except (PlotError, KeyError, TypeError):
        return sorted(p.name for p in grid.iterdir() if p.is_dir())


def k_axis(ax, n: int) -> None:
    """k on a log2 axis, ticked at 1, 2, 4, ... and n."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ticks = sorted({2 ** i for i in range(n.bit_length()) if 2 ** i <= n} | {n})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.set_xlim(0.85, n * 1.15)
    ax.set_xlabel("k (samples per problem; log2 scale)", fontsize=9)


def _arm_label(name: str, runs: int, trained: bool = True) -> str:
    return f"{name} ({runs} seed{'s' if runs != 1 else ''})" if trained else f"{name} (untrained)"


def passk_figure(data: PassFigure):
    """The figure of `plot_passk` (not saved) and the arms drawn: each arm's mean pass@k over its
    runs as a line with dots (dotted for an untrained arm), each run of an arm with several as a
    faint line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.4, 4.8), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    ks = list(range(1, data.n + 1))
    for index, arm in enumerate(data.arms):
        color = f"C{index % 10}"
        if len(arm.runs) > 1:
            for run in arm.runs:
                ax.plot(ks, run.values, color=color, alpha=0.3, linewidth=0.8, marker=".", markersize=3)
        ax.plot(ks, arm.mean, color=color, linewidth=1.8, marker="o", markersize=4,
                linestyle="-" if arm.trained else ":", label=_arm_label(arm.arm, len(arm.runs), arm.trained))
    k_axis(ax, data.n)
    ax.set_ylabel("pass@k (%): a problem solved by at least one of k samples", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    where = f", grid {data.name}" if data.name else ""
    faint = ", faint: each seed's run" if any(len(arm.runs) > 1 for arm in data.arms) else ""
    title = (f"pass@k against k on {data.dataset} ({data.n} samples per problem{where}): each arm's mean over "
             f"its runs{faint}; the flatter a curve, the less its samples differ")
    ax.set_title(textwrap.fill(title, 95), fontsize=9)
    return fig, [arm.arm for arm in data.arms]


def plot_passk(data: PassFigure, out) -> list[str]:
    """Draw pass@k against k (a PassFigure) into the PNG `out`; returns the arms drawn."""
    out = check_output(out)
    fig, drawn = passk_figure(data)
    common.save_png(fig, out)
    return drawn


def plot_grid_passk(grid_dir, out=None, arms: Sequence[str] | None = None) -> list[str]:
    """pass@k against k for the arms of a opsd.research.grid folder (default GRID_DIR/passk.png)."""
    reports, untrained = grid_reports(grid_dir, arms)  # first: a missing folder is the error to report
    out = check_output(out if out is not None else Path(grid_dir) / PASSK_FILE)
    return plot_passk(pass_figure(reports, Path(grid_dir).resolve().name, untrained), out)


# --------------------------------------------------------------------------
# Over steps: a swept grid's pass@1 and pass@n per checkpoint
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class SeedSteps:
    """One cell's checkpoints (its sweep.json): pass@1 and pass@n at each step."""
    label: str
    steps: tuple[int, ...]
    first: tuple[float, ...]  # pass@1
    last: tuple[float, ...]  # pass@n


@dataclass(frozen=True)
class ArmSteps:
    """An arm's seeds, and their mean at the steps every seed has."""
    arm: str
    seeds: tuple[SeedSteps, ...]
    steps: tuple[int, ...]
    first: tuple[float, ...]
    last: tuple[float, ...]


@dataclass(frozen=True)
class StepsFigure:
    """All that `steps_figure` draws; `baselines`: untrained arms as (name, pass@1, pass@n)."""
    name: str
    dataset: str
    n: int
    arms: tuple[ArmSteps, ...]
    baselines: tuple[tuple[str, float, float], ...]


def sweep_reports(sweep_path: Path) -> list[tuple[int, Path]]:
    """(step, report) of each checkpoint a cell's sweep.json lists (opsd.analysis.reports.sweep_reports),
    its problems as a PlotError."""
    try:
        return reports.sweep_reports(sweep_path)
    except reports.InputError as exc:
        raise PlotError(str(exc)) from None


def steps_data(grid_dir, arms: Sequence[str] | None = None) -> StepsFigure:
    """pass@1 and pass@n per checkpoint of a swept grid (every trained cell's sweep.json and the
    reports it lists); an untrained arm's eval.json as a baseline. A grid without a sweep is a
    PlotError."""
    reports, untrained = grid_reports(grid_dir, arms)
    eval_set = OneEvalSet()
    read = eval_set.read
    built, baselines = [], []
    for arm, runs in reports.items():
        if arm in untrained:
            values = read(runs[0][1])
            baselines.append((arm, values[0], values[-1]))
            continue
        seeds = []
        for label, report in runs:
            sweep = report.parent / "sweep.json"
            if sweep.is_file():
                rows = [(step, read(path)) for step, path in sweep_reports(sweep)]
                seeds.append(SeedSteps(label, tuple(s for s, _ in rows), tuple(v[0] for _, v in rows),
                                       tuple(v[-1] for _, v in rows)))
        if seeds:
            built.append(_arm_steps(arm, seeds))
    if not built:
        raise PlotError(f"{grid_dir}: no ARM/seed-N/sweep.json in it (a grid sweeps its checkpoints with "
                        "'sweep_every'; or no swept cell has finished yet)")
    dataset, n, _ = eval_set.first
    return StepsFigure(Path(grid_dir).resolve().name, dataset, n, tuple(built), tuple(baselines))


def _arm_steps(arm: str, seeds: list[SeedSteps]) -> ArmSteps:
    """The mean over the seeds at each step every seed has."""
    common_steps = sorted(set.intersection(*(set(s.steps) for s in seeds)))
    at = [dict(zip(s.steps, zip(s.first, s.last, strict=True), strict=True)) for s in seeds]  # step -> (p1, pn)
    first = tuple(sum(a[step][0] for a in at) / len(at) for step in common_steps)
    last = tuple(sum(a[step][1] for a in at) / len(at) for step in common_steps)
    return ArmSteps(arm, tuple(seeds), tuple(common_steps), first, last)


def steps_figure(data: StepsFigure):
    """The figure of `plot_steps` (not saved) and the arms drawn: pass@1 and pass@n against step,
    each arm's mean over its seeds as a line with dots, each seed of an arm with several faint,
    untrained arms as dotted horizontal lines."""
    fig, axes = common.new_figure(2, width=5.2, height=3.8, columns=2)
    for ax, which, label in ((axes[0], "first", "pass@1"), (axes[1], "last", f"pass@{data.n}")):
        for index, arm in enumerate(data.arms):
            color = f"C{index % 10}"
            if len(arm.seeds) > 1:
                for seed in arm.seeds:
                    ax.plot(seed.steps, getattr(seed, which), color=color, alpha=0.3, linewidth=0.8, marker=".",
                            markersize=3)
            ax.plot(arm.steps, getattr(arm, which), color=color, linewidth=1.8, marker="o", markersize=4,
                    label=_arm_label(arm.arm, len(arm.seeds)))
        for name, pass_first, pass_last in data.baselines:
            value = pass_first if which == "first" else pass_last
            ax.axhline(value, linestyle=":", color="0.35", linewidth=1.3, label=f"{name} (untrained): {value:.2f}")
        step_axis(ax)
        ax.set_title(f"{label} per checkpoint", fontsize=10)
        ax.set_ylabel(f"{label} (%)", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    faint = ", faint: each seed's run" if any(len(a.seeds) > 1 for a in data.arms) else ""
    fig.suptitle(textwrap.fill(f"pass@1 and pass@{data.n} over training steps on {data.dataset}, grid {data.name}: "
                               f"each arm's mean over its seeds at each swept checkpoint{faint}", 110), fontsize=10)
    return fig, [arm.arm for arm in data.arms] + [name for name, *_ in data.baselines]


def plot_steps(grid_dir, out=None, arms: Sequence[str] | None = None) -> list[str]:
    """pass@1 and pass@n over steps of a swept opsd.research.grid folder (default GRID_DIR/steps.png)."""
    data = steps_data(grid_dir, arms)  # first: a missing folder or sweep is the error to report
    out = check_output(out if out is not None else Path(grid_dir) / STEPS_FILE)
    fig, drawn = steps_figure(data)
    common.save_png(fig, out)
    return drawn
