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
