"""The per-checkpoint table of grids/results/long_runs.md: pass@1, pass@8, maj@8 and distinct answers
of base and of each arm's swept checkpoint reports, read from a long-runs grid folder whose sweeps did
not finish (no sweep.json for `opsd grid` to table).

    python grids/results/long_runs_table.py GRID_DIR
"""
import sys
from pathlib import Path

from opsd.analysis.problem_metrics import resolve_metric
from opsd.analysis.reports import load_run

METRICS = ("pass@1", "pass@8", "maj@8", "distinct")
ARMS = ("opsd_token", "opsd_token_constant", "opsd_entry", "opsd_noclip", "sft", "grpo")


def row(name: str, step: int, report: Path) -> str:
    run = load_run(report)
    values = []
    for text in METRICS:
        metric = resolve_metric(text, run.k)
        values.append(f"{metric.mean(metric.numerators(run)):.2f}")
    return f"| {name} | {step} | " + " | ".join(values) + " |"


def main(grid: Path) -> None:
    print("| arm | step | " + " | ".join(METRICS) + " |\n|---|---|" + "---|" * len(METRICS))
    print(row("base", 0, grid / "base" / "eval.json"))
    for arm in ARMS:
        reports = (grid / arm / "seed-0" / "eval").glob("eval_run_checkpoint-*.json")
        for report in sorted(reports, key=lambda p: int(p.stem.rsplit("-", 1)[1])):
            print(row(arm, int(report.stem.rsplit("-", 1)[1]), report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
