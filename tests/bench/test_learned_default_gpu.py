"""bench/learned_default_gpu.sh packs what a grid's analysis needs into OUT_DIR/grid.tgz (each cell's
sweep.json for `opsd.analysis.stats reach`, its timing.json), leaves checkpoints behind, and with GRID_NAME
runs a grid file into another folder of runs/. Run on a copy of the script whose python3 is a stub
that writes a grid folder as opsd.research.grid would."""
import os
import shutil
import stat
import subprocess
import tarfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FAKE_PYTHON = textwrap.dedent("""\
    #!/usr/bin/env bash
    # python3 -c ...: the environment check passes; python3 -m opsd.research.grid GRID --out DIR ...: a grid folder.
    [[ "$1" == -c ]] && exit 0
    out=$5
    for cell in base opsd/seed-0; do
      mkdir -p "$out/$cell/eval"
      echo '{}' > "$out/$cell/eval.json"; echo '{}' > "$out/$cell/timing.json"; echo '{}' > "$out/$cell/cell.json"
      echo '{}' > "$out/$cell/eval/eval_x.json"; echo log > "$out/$cell/eval.log"
    done
    mkdir -p "$out/opsd/seed-0/run/checkpoint-4"
    echo '{"checkpoints": []}' > "$out/opsd/seed-0/sweep.json"
    echo '{}' > "$out/opsd/seed-0/run/metrics.jsonl"; echo '{}' > "$out/opsd/seed-0/run/checkpoint-4/sweep.json"
    echo '| arm |' > "$out/results.md"; echo "grid $3 into $out"
""")


def _run_script(tmp_path: Path, *args: str, env=None) -> tuple[subprocess.CompletedProcess, Path]:
    root = tmp_path / "repo"  # the script and the environment it sources, as laid out in the repository
    for name in ("bench/learned_default_gpu.sh", "bench/gpu_env.sh"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, root / name)
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "OUT"
    run = subprocess.run(["bash", str(root / "bench" / "learned_default_gpu.sh"), str(out), *args],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", **(env or {})})
    return run, out


def test_grid_tgz_brings_back_sweeps_and_timings_not_checkpoints(tmp_path):
    run, out = _run_script(tmp_path, "g.json", "4")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "opsd.research.grid exit 0" in run.stdout
    with tarfile.open(out / "grid.tgz") as tar:
        names = sorted(tar.getnames())
    assert names == sorted([
        "g/results.md", "g/base/eval.json", "g/base/timing.json", "g/base/eval.log", "g/base/cell.json",
        "g/base/eval/eval_x.json", "g/opsd/seed-0/eval.json", "g/opsd/seed-0/timing.json", "g/opsd/seed-0/eval.log",
        "g/opsd/seed-0/cell.json", "g/opsd/seed-0/eval/eval_x.json",  # each checkpoint's report: pass@k over steps
        "g/opsd/seed-0/sweep.json", "g/opsd/seed-0/run/metrics.jsonl"])  # no checkpoint folder
    assert sorted(p.name for p in out.iterdir()) == ["grid.log", "grid.tgz", "machine.txt"]  # few files to return


def test_more_grids_run_beside_the_first_and_share_grid_tgz(tmp_path):
    run, out = _run_script(tmp_path, "first.json", "8", "second.json", "4")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "grid first.json into runs/first" in (out / "grid.log").read_text()
    assert "grid second.json into runs/second" in (out / "grid-second.log").read_text()
    with tarfile.open(out / "grid.tgz") as tar:
        assert {name.split("/")[0] for name in tar.getnames()} == {"first", "second"}


def test_grid_name_runs_a_part_into_the_whole_grids_folder(tmp_path):
    run, out = _run_script(tmp_path, "part_a.json", "4", env={"GRID_NAME": "whole"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "grid part_a.json into runs/whole" in (out / "grid.log").read_text()
    with tarfile.open(out / "grid.tgz") as tar:
        assert {name.split("/")[0] for name in tar.getnames()} == {"whole"}
