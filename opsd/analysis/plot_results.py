"""A grid's accuracy against what its arms spent or varied: against sampled tokens through
its checkpoints (accuracy_vs_tokens.png, from the grid folder), and from its results.json alone
(`python -m opsd.analysis.plots results`) against tokens, unique problems or learning rate.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

from opsd.analysis import plot_common as common
from opsd.analysis.plot_common import DPI, PlotError, check_output

ACCURACY_VS_TOKENS_FILE = "accuracy_vs_tokens.png"  # beside results.md of a grid with sweep_every


def accuracy_vs_tokens_figure(table: dict):
    """The figure of `plot_accuracy_vs_tokens` (not saved), and the labels of the arms drawn.
    `table`: an `opsd.analysis.stats.grid_table`. A trained arm that samples tokens: its points
    (mean sampled tokens, mean accuracy over its seeds) joined in step order, with a band from
    the lowest to the highest seed's accuracy; an arm that samples nothing (SFT) and the
    untrained arm: horizontal lines at their (last) accuracy, dashed and dotted. Points whose
    sampled tokens a seed did not record are left out (the title names such arms)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    from opsd.analysis.tokens import format_tokens, samples_nothing

    metric = table["metric"]
    fig = Figure(figsize=(7.4, 4.6), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    drawn, lines, missing = [], [], []
    for index, (name, arm) in enumerate(table["arms"].items()):
        color = f"C{index % 10}"
        if not arm["trained"]:
            lines.append((name, f"{name} (untrained): {arm['points'][-1]['accuracy']:.2f}",
                          arm["points"][-1]["accuracy"], ":", "0.35"))
            continue
        if samples_nothing(arm):
            last = arm["points"][-1]
            lines.append((name, f"{name}: samples no tokens, last checkpoint {last['accuracy']:.2f} "
                          f"(mean of {len(arm['seeds'])} seeds)", last["accuracy"], "--", color))
            continue
        points = [p for p in arm["points"] if p["sampled_tokens"] is not None]
        if not points:
            missing.append(name)
            continue
        x = [p["sampled_tokens"] for p in points]
        ax.plot(x, [p["accuracy"] for p in points], marker="o", markersize=4, color=color, linewidth=1.4,
                label=f"{name} ({len(arm['seeds'])} seed{'s' if len(arm['seeds']) != 1 else ''})")
        if len(arm["seeds"]) > 1:
            ax.fill_between(x, [min(p["accuracy_per_seed"]) for p in points],
                            [max(p["accuracy_per_seed"]) for p in points], color=color, alpha=0.15, linewidth=0)
        drawn.append(name)
    if not drawn and not any(style == "--" for *_, style, _ in lines):  # only the untrained line: no axis
        raise PlotError(f"grid {table['grid']}: no trained arm recorded its sampled tokens (tokens/sampled in "
                        f"metrics.jsonl; runs from before it do not have it)")
    for name, label, accuracy, style, color in lines:
        ax.axhline(accuracy, linestyle=style, color=color, linewidth=1.3, label=label)
        drawn.append(name)
    ax.set_xlabel("sampled tokens (cumulative, mean over seeds)", fontsize=9)
    ax.set_ylabel(f"{metric} (%)", fontsize=9)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _pos: "0" if value == 0 else format_tokens(value)))
    ax.set_xlim(left=0)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    title = (f"{metric} against sampled tokens, grid {table['grid']}: each arm's mean over its seeds at each "
             f"{'swept' if table['swept'] else 'last'} checkpoint, band from the lowest to the highest seed")
    if missing:
        title += f"; not drawn (sampled tokens not recorded): {', '.join(missing)}"
    ax.set_title(textwrap.fill(title, 95), fontsize=9)
    return fig, drawn


def plot_accuracy_vs_tokens(table: dict, out) -> list[str]:
    """Accuracy against sampled tokens of a grid (`table`: `opsd.analysis.stats.grid_table` of the
    grid folder) into the PNG `out` (a grid's is GRID_DIR/accuracy_vs_tokens.png). Returns the
    arms drawn."""
    out = check_output(out)
    fig, drawn = accuracy_vs_tokens_figure(table)
    common.save_png(fig, out)
    return drawn


# --------------------------------------------------------------------------
# A grid's results.json alone (no run folders): accuracy against tokens, data or a setting
# --------------------------------------------------------------------------

# `results --x`: what each arm's point is placed at, (axis label, axis scale). Token counts are
# results.json fields (the mean and `FIELD_per_run`); the others are read from the arm's settings.
RESULTS_X = {
    "sampled_tokens": ("sampled tokens (completions the student sampled in training)", "linear"),
    "forward_tokens": ("forward tokens (training compute: tokens through the training forwards)", "linear"),
    "unique_problems": ("unique training problems (N of --dataset_name tiny:SEED:N; log scale)", "log2"),
    "learning_rate": ("learning rate (the arm's recipe, else the grid's; log scale)", "log10"),
}
TOKEN_X = ("sampled_tokens", "forward_tokens")
DEFAULT_GROUP = r"^[^_]+"  # unique_problems, learning_rate: one line per name prefix (opsd_n64 -> opsd)


@dataclass(frozen=True)
class ResultsPoint:
    """One arm of a results.json: its mean (x, accuracy) over its seeds and each seed's run."""
    arm: str
    group: str
    x: float
    accuracy: float
    runs: tuple[tuple[float, float], ...]  # (x, accuracy) of each seed's run


@dataclass(frozen=True)
class ResultsFigure:
    """What `results_points` reads from a results.json, all that `results_figure` draws."""
    name: str
    metric: str
    eval_data: str
    x: str
    points: tuple[ResultsPoint, ...]
    baselines: tuple[tuple[str, float], ...]  # untrained arms: (name, accuracy), horizontal lines
    group_labels: dict  # {group: legend label} of groups of several arms (lines)
    left_out: tuple[str, ...] = ()  # trained arms without the x value ("arm (why)")


def read_results(path) -> dict:
    """A grid's results.json (opsd.research.grid writes it; grids/results/ holds copies)."""
    import json

    file = Path(path)
    if not file.is_file():
        raise PlotError(f"{path}: no such file")
    try:
        table = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise PlotError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(table, dict) or not isinstance(table.get("arms"), dict) or not table["arms"]:
        raise PlotError(f"{path}: no 'arms' in it (not the results.json of a opsd.research.grid)")
    return table


def _flag_value(flags, name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in an arm's flags (the last one given)."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif isinstance(flag, str) and flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
    return value


def unique_problems(table: dict, arm: str) -> int:
    """How many training rows (unique problems) an arm trained on: N of its `--dataset_name
    tiny:SEED:N` (`tiny` and `tiny:SEED` are the 4,096-row default; the tiny preset's data is
    `tiny`). Another dataset name does not say its size: a PlotError."""
    from opsd import tiny_default

    entry = table["arms"][arm]
    name = _flag_value(entry.get("flags") or [], "--dataset_name")
    if name is None and (table.get("grid") or {}).get("preset") == "tiny":
        name = tiny_default.TINY
    if name is None or not tiny_default.is_tiny_name(name):
        raise PlotError(f"arm {arm}: its unique training problems are not known (--dataset_name {name or 'not given'}; "
                        f"only a tiny set, {tiny_default.NAME_FORMS}, says its size)")
    return tiny_default.train_rows(name)


def recipe_value(table: dict, arm: str, key: str):
    """A recipe key of an arm: its own recipe's, else the grid's; None when neither sets it."""
    own = table["arms"][arm].get("recipe") or {}
    return own[key] if key in own else ((table.get("grid") or {}).get("recipe") or {}).get(key)


def _arm_x(table: dict, arm: str, x: str) -> tuple[float | None, list | None]:
    """(the arm's x, each run's x or None where the JSON has one value for all runs)."""
    entry = table["arms"][arm]
    if x in TOKEN_X:
        per_run = entry.get(f"{x}_per_run")
        return entry.get(x), per_run if isinstance(per_run, list) else None
    if x == "unique_problems":
        return unique_problems(table, arm), None
    value = recipe_value(table, arm, x)
    return (float(value) if isinstance(value, (int, float)) else None), None


def _group_of(arm: str, pattern) -> str:
    """An arm's group: the `--group` regex's capture groups joined by `_`, or its match; an arm
    it does not match (and every arm without a regex) is a group of its own."""
    match = pattern.search(arm) if pattern is not None else None
    if not match:
        return arm
    return "_".join(g for g in match.groups() if g) if pattern.groups else match.group(0) or arm


def _group_labels(table: dict, groups: dict[str, list[str]], x: str) -> dict[str, str]:
    """{group: legend label} for groups of several arms: the group's name and the recipe keys its
    arms share that another group sets otherwise (grpo (learning_rate 0.0001, max_grad_norm 1))."""
    keys = sorted({k for arms in groups.values() for a in arms for k in (table["arms"][a].get("recipe") or {})}
                  | set((table.get("grid") or {}).get("recipe") or {}))
    shared = {}
    for group, arms in groups.items():
        values = {}
        for key in keys:
            seen = {repr(recipe_value(table, a, key)) for a in arms}
            if len(seen) == 1 and key != x:
                values[key] = recipe_value(table, arms[0], key)
        shared[group] = values
    labels = {}
    for group, arms in groups.items():
        if len(arms) < 2:
            continue
        differing = [f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in shared[group].items()
                     if v is not None and any(other.get(k, "absent") != v
                                              for g, other in shared.items() if g != group)]
        labels[group] = f"{group} ({', '.join(differing)})" if differing else group
    return labels


def results_points(table: dict, x: str = "sampled_tokens", group: str | None = None,
                   name: str = "grid") -> ResultsFigure:
    """The points of a results.json (`read_results`) against `x` (a RESULTS_X key): each trained,
    evaluated arm at its mean x and its `mean` accuracy, with each seed's run at its own x
    (`FIELD_per_run`, where the JSON has it) and accuracy (`per_run`); untrained arms (the
    base) as baselines. `group`: a regex naming each arm's group (default: none for tokens,
    DEFAULT_GROUP otherwise). A trained arm without the x value is left out (named); none with
    it is a PlotError naming the field."""
    import re

    if x not in RESULTS_X:
        raise PlotError(f"--x {x}: expected one of {', '.join(RESULTS_X)}")
    if group is None and x not in TOKEN_X:
        group = DEFAULT_GROUP
    try:
        pattern = re.compile(group) if group else None
    except re.error as exc:
        raise PlotError(f"--group {group!r}: not a regular expression ({exc})") from None
    arms = table["arms"]
    evaluated = {a: e for a, e in arms.items() if isinstance(e, dict) and isinstance(e.get("mean"), (int, float))}
    if not evaluated:
        raise PlotError(f"{name}: no arm has a 'mean' accuracy (no cell evaluated yet)")
    baselines, points, left_out = [], [], []
    for arm, entry in evaluated.items():
        if not entry.get("trained", True):
            baselines.append((arm, float(entry["mean"])))
            continue
        mean_x, per_run_x = _arm_x(table, arm, x)
        if not isinstance(mean_x, (int, float)):
            left_out.append(f"{arm} ({x} not recorded)")
            continue
        accuracies = [float(v) for v in entry.get("per_run") or []]
        if (per_run_x is None or len(per_run_x) != len(accuracies)
                or not all(isinstance(v, (int, float)) for v in per_run_x)):
            per_run_x = [mean_x] * len(accuracies)
        points.append(ResultsPoint(arm, _group_of(arm, pattern), float(mean_x), float(entry["mean"]),
                                   tuple((float(px), acc) for px, acc in zip(per_run_x, accuracies, strict=True))))
    if not points:
        where = "recipe" if x == "learning_rate" else "results"
        raise PlotError(f"{name}: no trained arm has {x!r} in its {where} (fields of an arm: "
                        f"{', '.join(sorted(next(iter(evaluated.values()))))})")
    groups: dict[str, list[str]] = {}
    for point in points:
        groups.setdefault(point.group, []).append(point.arm)
    metric = next((e["metric"] for e in evaluated.values() if "metric" in e), "accuracy")
    eval_data = (table.get("grid") or {}).get("eval_data") or "the eval set"
    return ResultsFigure(name, metric, eval_data, x, tuple(points), tuple(baselines),
                         _group_labels(table, groups, x), tuple(left_out))


def results_figure(data: ResultsFigure):
    """The figure of `plot_results` (not saved) and the arms drawn: each arm's mean as a large dot,
    each seed's run as a small one in its colour; a group of several arms joined by a line (in x
    order, in the legend), an arm of its own labelled beside its dot; untrained arms as dotted
    horizontal lines."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    from opsd.analysis.tokens import format_tokens

    fig = Figure(figsize=(8.0, 5.0), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    groups: dict[str, list[ResultsPoint]] = {}
    for point in data.points:
        groups.setdefault(point.group, []).append(point)
    drawn = []
    for index, (group, points) in enumerate(groups.items()):
        color = f"C{index % 10}"
        points = sorted(points, key=lambda p: p.x)
        runs = [run for p in points for run in p.runs]
        ax.plot([r[0] for r in runs], [r[1] for r in runs], "o", color=color, markersize=3.5, alpha=0.55,
                markeredgewidth=0)
        if len(points) > 1:
            ax.plot([p.x for p in points], [p.accuracy for p in points], "-o", color=color, markersize=7,
                    markeredgecolor="black", markeredgewidth=0.6, linewidth=1.4, label=data.group_labels[group])
        else:
            ax.plot([points[0].x], [points[0].accuracy], "o", color=color, markersize=7, markeredgecolor="black",
                    markeredgewidth=0.6)
            ax.annotate(f"{points[0].arm} {points[0].accuracy:.2f}", (points[0].x, points[0].accuracy),
                        xytext=(7, -3), textcoords="offset points", fontsize=8, color=color)
        drawn += [p.arm for p in points]
    for name, accuracy in data.baselines:
        ax.axhline(accuracy, linestyle=":", color="0.35", linewidth=1.3, label=f"{name} (untrained): {accuracy:.2f}")
        drawn.append(name)
    # Seed dots and means in the legend, as a reader needs them once.
    ax.plot([], [], "o", color="0.5", markersize=7, markeredgecolor="black", markeredgewidth=0.6,
            label="arm: mean over its seeds")
    ax.plot([], [], "o", color="0.5", markersize=3.5, alpha=0.55, markeredgewidth=0, label="one seed's run")
    label, scale = RESULTS_X[data.x]
    ax.set_xlabel(label, fontsize=9)
    ax.set_ylabel(f"{data.metric} accuracy (%)", fontsize=9)
    values = sorted({p.x for p in data.points})
    if scale == "linear":
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: "0" if v == 0 else format_tokens(v)))
        right = max(max(r[0] for p in data.points for r in p.runs), max(values))
        ax.set_xlim(0, right * 1.25)  # room for the labels right of the dots
    else:
        ax.set_xscale("log", base=2 if scale == "log2" else 10)
        ax.xaxis.set_major_locator(FixedLocator(values))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}" if scale == "log2" else f"{v:g}"))
        labelled = any(len(points) == 1 for points in groups.values())  # room for a label right of the dot
        ax.set_xlim(values[0] / 1.5, values[-1] * (2.5 if labelled else 1.5))
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    seeds = sorted({len(p.runs) for p in data.points})
    title = (f"{data.metric} on {data.eval_data} against {data.x.replace('_', ' ')}, grid {data.name} "
             f"({'/'.join(map(str, seeds))} seeds an arm): large dot the arm's mean, small dots its seeds' runs")
    if data.left_out:
        title += f"; not drawn: {', '.join(data.left_out)}"
    ax.set_title(textwrap.fill(title, 100), fontsize=9)
    return fig, drawn


def results_name(path) -> str:
    """A results file as a reader names its grid: GRID/results.json by its folder, a copy in
    grids/results/ by its file name."""
    file = Path(path)
    return file.resolve().parent.name if file.stem == "results" else file.stem


def plot_results(path, x: str = "sampled_tokens", out=None, group: str | None = None) -> tuple[Path, list[str]]:
    """Draw a grid's results.json against `x` into `out` (default: beside the JSON,
    NAME_X.png). Returns the PNG's path and the arms drawn."""
    table = read_results(path)  # first: a missing file is the error to report
    name = results_name(path)
    out = check_output(out if out is not None else Path(path).with_name(f"{name}_{x}.png"))
    fig, drawn = results_figure(results_points(table, x, group, name))
    common.save_png(fig, out)
    return out, drawn

