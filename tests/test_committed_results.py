"""The 2026-12-06 results committed under grids/results/ are what their commands print from the
reports committed beside them (grids/results/raw/): the long runs' per-checkpoint table, and the
data-size grid's results.json re-made with `opsd grid --results-only`."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAW = REPO / "grids" / "results" / "raw" / "2026-12-06_data_size_n64_long_runs.tgz"


def _unpack(tmp_path: Path) -> Path:
    with tarfile.open(RAW) as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path


def test_the_long_runs_table_is_what_its_script_prints_from_the_reports(tmp_path):
    runs = _unpack(tmp_path)
    printed = subprocess.run([sys.executable, str(REPO / "grids" / "results" / "long_runs_table.py"),
                              str(runs / "long_runs")], capture_output=True, text=True, check=True).stdout
    page = (REPO / "grids" / "results" / "long_runs.md").read_text(encoding="utf-8")
    assert printed.count("\n") == 18 and printed in page


def test_the_data_size_results_are_remade_from_the_cells(tmp_path):
    runs = _unpack(tmp_path)
    made = subprocess.run([sys.executable, "-m", "opsd.research.grid",
                           str(REPO / "grids" / "grpo_tuned" / "data_size_3seeds" / "part_a.json"),
                           "--out", str(runs / "data_size_3seeds"), "--results-only"],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items() if not k.startswith("OPSD_")})  # as they ran
    assert made.returncode == 0, made.stderr[-2000:]
    remade = json.loads((runs / "data_size_3seeds" / "results.json").read_text())
    committed = json.loads((REPO / "grids" / "results" / "grpo_tuned_data_size_3seeds.json").read_text())
    for table in (remade, committed):  # how the cells ran (seconds, sharing), not what they scored
        for arm in table["arms"].values():
            arm.pop("wall_time", None)
    assert remade == committed


def test_the_token_splits_against_opsd_are_welch_on_the_committed_run_means():
    """grids/results/grpo_tuned_token_splits.md's "Against OPSD" rows (issue 59 item 4): Welch's t on the
    run means its JSON holds, and the TOST p it quotes for the 4x-token arm."""
    from opsd.analysis.evidence import tost
    from opsd.analysis.significance import welch_t

    table = json.loads((REPO / "grids" / "results" / "grpo_tuned_token_splits.json").read_text())
    page = (REPO / "grids" / "results" / "grpo_tuned_token_splits.md").read_text(encoding="utf-8")
    opsd = table["arms"]["opsd"]["per_run"]
    for name, arm in table["arms"].items():
        if name not in ("base", "opsd"):
            w = welch_t(opsd, arm["per_run"])
            assert (f"| {name} | {arm['mean']:.2f} | {w['diff']:+.2f} | [{w['ci'][0]:+.2f}, {w['ci'][1]:+.2f}] | "
                    f"{w['p']:.3g} |") in page
    assert f"p = {tost(opsd, table['arms']['grpo_g8_p16']['per_run'], 3.0)['p']:.2f})" in page


def test_the_long_runs_step_75_comparisons_are_what_compare_prints(tmp_path):
    """The numbers grids/results/long_runs.md quotes at step 75 (`opsd stats compare --metric M` on two
    reports, 10,000 resamples, seed 0): difference, 95% CI and, for pass@8, the sign-flip p."""
    from opsd.analysis.comparison import compare_arms
    from opsd.analysis.problem_metrics import resolve_metric
    from opsd.analysis.reports import check_comparable, load_run

    runs = _unpack(tmp_path) / "long_runs"
    step75 = "seed-0/eval/eval_run_checkpoint-75.json"
    page = " ".join((REPO / "grids" / "results" / "long_runs.md").read_text(encoding="utf-8").split())

    def compare(a: Path, b: Path, metric: str) -> dict:
        run_a, run_b = load_run(a), load_run(b)
        m = resolve_metric(metric, run_a.k)
        return compare_arms([run_a], [run_b], check_comparable([run_a, run_b], m), 10000, 0, metric=m)

    def quoted(result: dict) -> str:
        low, high = result["bootstrap"]["ci"]
        return f"{result['difference']:+.2f} [{low:+.2f}, {high:+.2f}]"

    base, opsd, sft = runs / "base" / "eval.json", runs / "opsd_token_constant" / step75, runs / "sft" / step75
    gain = compare(base, opsd, "avg@8")
    assert f"{gain['difference']:+.2f} points {quoted(gain).split(' ', 1)[1]}" in page
    assert f"{quoted(compare(base, opsd, 'pass@8'))} at pass@8" in page
    assert f"at pass@1 ({quoted(compare(opsd, sft, 'avg@8'))})" in page
    versus = compare(opsd, sft, "pass@8")
    low, high = versus["bootstrap"]["ci"]
    assert versus["difference"] == 9.0 and f"[{low:+.2f}, {high:+.2f}] (sign-flip p = 0.035)" in page
    assert round(versus["per_problem"]["sign_flip_p"], 3) == 0.035
    distinct = compare(opsd, sft, "distinct")
    assert f"{distinct['difference']:.2f} more distinct answers {quoted(distinct).split(' ', 1)[1]}" in page
