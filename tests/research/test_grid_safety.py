"""A grid's cells have one writer each and say what they depend on: the grid's own lock per --out,
the cell lock, an atomic takeover of a stale lock, the cell's identity (process count, inherited
variables) and code version, free ports, progress lines, and one cell's crash kept to that cell.
Each of these failed before its fix (2026-12-05); none trains a model."""
import json
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from grid_cases import GRID, run_grid

import opsd.research.grid
from opsd.evaluation import evaluate
from opsd.research import cell as grid_cell
from opsd.research import executors

REPO = Path(__file__).resolve().parents[2]


def _grid(tmp_path):
    grid_file = tmp_path / "g.json"
    grid_file.write_text(json.dumps(GRID))
    grid = opsd.research.grid.load_grid(str(grid_file))
    return grid_file, grid, opsd.research.grid.cells(grid, tmp_path / "out")


def _hold_run_lock(folder: Path) -> subprocess.Popen:
    """Another live process holding `folder`'s RunLock (returns once it holds it; kill it to release)."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from opsd.run_folder import RunLock
        with RunLock({str(folder)!r}):
            print("held", flush=True)
            time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _only_error_line(run) -> str:
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    return lines[0]


def test_a_second_grid_on_the_same_out_is_refused_and_a_dead_ones_lock_is_not_stale(tmp_path):
    grid_file, _, _ = _grid(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from opsd.research.grid import GridLock
        with GridLock(Path({str(out)!r})):
            print("held", flush=True)
            time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = _only_error_line(run_grid(grid_file, out))
        assert f"another grid is running into {out} (PID {holder.pid} on {socket.gethostname()})" in line
        assert sorted(p.name for p in out.iterdir()) == [".grid.lock"]  # nothing else written
    finally:
        holder.kill()
        holder.wait()
    # The kernel dropped the killed holder's lock: the next grid takes it (dry of cells: one cell only).
    with opsd.research.grid.GridLock(out):
        pass


def test_two_takers_of_a_stale_lock_never_both_win(tmp_path):
    """Before the fix (check, unlink, link without a guard) both takers won: the second unlinked
    the first's fresh lock. Each taker pauses between its check and its takeover."""
    folder = tmp_path / "run"
    folder.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (folder / ".lock").write_text(f"{dead.pid} {socket.gethostname()} -\n")  # a stale lock: its PID is gone
    taker = textwrap.dedent(f"""
        import time
        from opsd import run_folder
        check = run_folder.RunLock.check
        def slow_check(self):
            check(self)
            time.sleep(1.0)  # widen the window between the check and the takeover
        run_folder.RunLock.check = slow_check
        lock = run_folder.RunLock({str(folder)!r})
        try:
            lock.acquire()
            print("won", flush=True)
            time.sleep(3)
        except run_folder.RunFolderError as exc:
            print("refused", exc, flush=True)
    """)
    takers = [subprocess.Popen([sys.executable, "-c", taker], stdout=subprocess.PIPE, text=True, cwd=REPO)
              for _ in range(2)]
    said = sorted(t.communicate(timeout=60)[0].split()[0] for t in takers)
    assert said == ["refused", "won"]


def test_a_cell_held_by_a_live_runner_is_refused_not_run_twice(tmp_path):
    _, grid, cells = _grid(tmp_path)
    cell = cells[0]
    cell.folder.mkdir(parents=True)
    holder = _hold_run_lock(cell.folder)
    try:
        outcome = grid_cell.run_cell(grid, cell, lambda message: None, gpus=())
    finally:
        holder.kill()
        holder.wait()
    assert outcome.startswith(f"failed: {cell.folder} is in use by another run (PID {holder.pid} ")
    assert not (cell.folder / "train.log").exists()


def test_a_cell_resumed_at_another_process_count_or_environment_is_refused(tmp_path, monkeypatch):
    _, grid, cells = _grid(tmp_path)
    cell = cells[0]
    cell.folder.mkdir(parents=True)
    monkeypatch.setenv("OPSD_PAD_SIDE", "left")
    recorded = grid_cell.cell_identity(grid, cell, processes=2)
    (cell.folder / "cell.json").write_text(json.dumps(recorded))
    with pytest.raises(opsd.research.grid.GridError,
                       match=r"\(processes: 2 there, 1 now\); re-run with --gpus-per-cell"):
        opsd.research.grid.check_cell_identity(grid, cell, processes=1)
    opsd.research.grid.check_cell_identity(grid, cell, processes=2)
    monkeypatch.setenv("OPSD_PAD_SIDE", "right")
    with pytest.raises(opsd.research.grid.GridError, match=r"variables.OPSD_PAD_SIDE: 'left' there, 'right' now"):
        opsd.research.grid.check_cell_identity(grid, cell, processes=2)
    monkeypatch.delenv("OPSD_PAD_SIDE")
    # A cell.json written before `processes` and `variables` were recorded is not compared on them.
    old = {k: v for k, v in recorded.items() if k not in ("processes", "variables")}
    (cell.folder / "cell.json").write_text(json.dumps(old))
    opsd.research.grid.check_cell_identity(grid, cell, processes=4)


def test_a_started_cell_does_not_resume_on_other_code_unless_allowed(tmp_path):
    _, grid, cells = _grid(tmp_path)
    cell = cells[0]
    (cell.folder / "run" / "checkpoint-1").mkdir(parents=True)
    identity = grid_cell.cell_identity(grid, cell)
    (cell.folder / "cell.json").write_text(json.dumps({**identity, "provenance": {"code": "0123abcd"}}))
    with pytest.raises(opsd.research.grid.GridError, match="started on code 0123abcd, the checkout is now 4567ef"):
        grid_cell.check_cell_code(cell, "4567ef")
    grid_cell.check_cell_code(cell, "4567ef", allow_change=True)
    grid_cell.check_cell_code(cell, "0123abcd")
    cell.report.write_text("{}")  # a finished cell's result stands, whatever ran it
    grid_cell.check_cell_code(cell, "4567ef")


def test_the_cells_run_a_snapshot_of_the_code_made_once_per_version(tmp_path):
    repo = _repo(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    version, folder = grid_cell.snapshot_code(out, repo)
    assert folder == out / ".code" / version  # hidden: no scan of the package tree takes it for opsd/
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "configs/ddp.yaml", "opsd_train.py"]  # tests, docs and notes left out
    assert grid_cell.snapshot_code(out, repo) == (version, folder)  # the same version: the same copy
    (repo / "opsd_train.py").write_text("print('edited')\n")  # an uncommitted edit: a new version, a new copy
    edited, edited_folder = grid_cell.snapshot_code(out, repo)
    assert edited.startswith(version + "+dirty-")
    assert (edited_folder / "opsd_train.py").read_text() == "print('edited')\n"
    assert (folder / "opsd_train.py").read_text() == "print('v1')\n"  # the first copy is untouched
    assert grid_cell.snapshot_code(out, tmp_path / "not-a-repo") == (None, tmp_path / "not-a-repo")
    # A cell whose snapshot was deleted says so instead of running other code.
    _, grid, cells = _grid(tmp_path)
    outcome = grid_cell.run_cell(grid, cells[0], lambda message: None, gpus=(), code_dir=tmp_path / "gone")
    assert outcome == f"failed: the grid's code snapshot {tmp_path / 'gone'} is gone; re-run the grid to make it again"



def test_a_grid_folder_keeps_using_its_snapshot_in_the_old_place(tmp_path):
    """Grid folders made before the snapshot moved to .code/ hold it in code/<version>/ (SLURM jobs
    queued with that path): a re-run of the same version uses it instead of copying again."""
    repo = _repo(tmp_path)
    out = tmp_path / "out"
    (out / "code").mkdir(parents=True)
    version = grid_cell.code_version(repo)
    (out / "code" / version).mkdir()
    assert grid_cell.snapshot_code(out, repo) == (version, out / "code" / version)
    assert not (out / ".code").exists()


def _repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    (repo / "configs").mkdir(parents=True)
    (repo / "tests").mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "opsd_train.py").write_text("print('v1')\n")
    (repo / "configs" / "ddp.yaml").write_text("x: 1\n")
    (repo / "tests" / "test_x.py").write_text("\n")
    (repo / "notes.md").write_text("notes\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    return repo


def test_the_code_version_is_the_commit_and_a_hash_of_edited_code_files(tmp_path):
    repo = _repo(tmp_path)
    clean = grid_cell.code_version(repo)
    assert len(clean) == 12 and "+" not in clean
    (repo / "notes.md").write_text("edited notes\n")  # docs are not code
    assert grid_cell.code_version(repo) == clean
    (repo / "opsd_train.py").write_text("x = 2\n")
    edited = grid_cell.code_version(repo)
    assert edited.startswith(clean + "+dirty-") and grid_cell.code_version(repo) == edited
    assert grid_cell.code_version(tmp_path / "not-a-repo") is None


def test_one_cells_exception_is_that_cells_failure_and_the_others_run(tmp_path, monkeypatch):
    _, grid, cells = _grid(tmp_path)
    ran = []

    def run_cell(grid, cell, log, **kwargs):
        ran.append((cell.name, kwargs.get("port")))
        if cell.name == "entry/seed-1":
            raise ValueError("a bug in one cell")
        return "done"

    monkeypatch.setattr(opsd.research.grid, "run_cell", run_cell)
    args = SimpleNamespace(gpus_per_cell=2, parallel=None, cells_per_gpu=1, progress_every=30)
    slots = executors.gpu_slots(["0", "1", "2", "3"], 2, 1)
    outcomes = opsd.research.grid.run_here(grid, cells, args, ["0", "1", "2", "3"], slots, lambda message: None)
    assert sorted(name for name, _ in ran) == sorted(c.name for c in cells)
    assert all(port is None for _, port in ran)  # the cell picks a free port itself, none fixed per slot
    failed = outcomes.pop("entry/seed-1")
    assert failed.startswith("failed: ValueError: a bug in one cell (traceback in ")
    assert "a bug in one cell" in (tmp_path / "out" / "entry" / "seed-1" / "error.log").read_text()
    assert set(outcomes.values()) == {"done"}


def test_a_free_port_is_one_nothing_listens_on():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = executors.free_port()
        assert port != taken.getsockname()[1]
    with socket.socket() as again:
        again.bind(("", port))  # free: bindable


def test_progress_is_the_last_bar_of_a_log(tmp_path):
    log = tmp_path / "train.log"
    assert grid_cell.log_progress(log) is None  # no log yet
    log.write_text("$ python opsd_train.py ...\n[OPSD] loading\n")
    assert grid_cell.log_progress(log) is None  # no bar yet
    with open(log, "a") as f:  # tqdm rewrites its line with \r
        f.write("  0%|          | 0/8 [00:00<?, ?it/s]\r 25%|##5       | 2/8 [00:04<00:12,  2.00s/it]\r"
                " 38%|###7      | 3/8 [00:06<00:10,  2.00s/it]")
    assert grid_cell.log_progress(log) == "3/8, about 00:10 left"
    log.write_text("sampling:   0%|          | 0/16 [00:00<?, ?sample/s]")
    assert grid_cell.log_progress(log) == "0/16"


def test_the_grid_fixes_the_evaluations_kv_pool_and_the_evaluation_reads_it(tmp_path, monkeypatch):
    monkeypatch.delenv("OPSD_EVAL_PAGED_GIB", raising=False)
    assert grid_cell.eval_environment() == {"OPSD_EVAL_PAGED_GIB": grid_cell.EVAL_PAGED_GIB}
    monkeypatch.setenv("OPSD_EVAL_PAGED_GIB", "8")
    assert grid_cell.eval_environment() == {"OPSD_EVAL_PAGED_GIB": "8"}
    args = evaluate.parse_args(["base", "--preset", "tiny", "--engine", "paged", "--output-dir", str(tmp_path)])
    request, _ = evaluate.build_request(args)
    assert request.paged_cache_gib == 8.0  # not a share of this machine's memory
    monkeypatch.setenv("OPSD_EVAL_PAGED_GIB", "lots")
    with pytest.raises(evaluate.InputError, match="OPSD_EVAL_PAGED_GIB='lots': expected a size in GiB > 0"):
        evaluate.build_request(args)
    monkeypatch.setenv("OPSD_EVAL_PAGED_GIB", "8")
    args = evaluate.parse_args(["base", "--preset", "tiny", "--engine", "dynamic", "--output-dir", str(tmp_path)])
    assert evaluate.build_request(args)[0].paged_cache_gib is None  # other engines ignore it


def test_the_cells_identity_names_the_inherited_variables_but_not_the_arms_own(tmp_path):
    _, grid, cells = _grid(tmp_path)
    token = next(c for c in cells if c.arm.name == "token")
    environ = {"OPSD_CLIP_MODE": "entry", "OPSD_PAD_SIDE": "left", "HOME": "/root"}
    identity = grid_cell.cell_identity(grid, token, processes=1, environ=environ)
    assert identity["env"] == {"OPSD_CLIP_MODE": "token"}
    assert identity["variables"] == {"OPSD_PAD_SIDE": "left", "OPSD_EVAL_PAGED_GIB": grid_cell.EVAL_PAGED_GIB}


def test_a_cell_killed_for_its_requeue_takes_its_ranks_with_it(tmp_path):
    """A multi-GPU cell's ranks run in sessions of their own (torchrun's start_new_session): killing
    only the launcher left them running (before: `child.kill()`). kill_tree reaches them."""
    from opsd.research import slurm_grid

    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys, time
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        print(rank.pid, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    rank = int(launcher.stdout.readline())
    assert rank in slurm_grid.descendants(launcher.pid)
    slurm_grid.kill_tree(launcher.pid)
    launcher.wait(timeout=30)
    for _ in range(100):  # the rank is gone once its parent reaps it (or init does)
        state = Path(f"/proc/{rank}/stat")
        if not state.exists() or state.read_text().split(") ")[-1].startswith("Z"):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"rank {rank} still runs")


def test_status_names_the_process_running_a_cell_here(tmp_path):
    """A cell a grid runs on this machine (no SLURM job) shows as running, with its host and PID from
    the cell lock; before, status said 'not finished' for a cell in full training."""
    from opsd.research import slurm_grid

    _, grid, cells = _grid(tmp_path)
    cell = cells[0]
    cell.folder.mkdir(parents=True)
    (cell.folder / "cell.json").write_text(json.dumps(grid_cell.cell_identity(grid, cell)))
    (cell.folder / "train.log").write_text(" 25%|##5       | 1/4 [00:04<00:12,  4.00s/it]")
    holder = _hold_run_lock(cell.folder)
    try:
        rows = {name: (state, rest) for name, state, rest in slurm_grid.cell_states(tmp_path / "out")}
    finally:
        holder.kill()
        holder.wait()
    state, rest = rows[cell.name]
    assert state == "running" and rest.startswith(f"on {socket.gethostname()} (PID {holder.pid}); train 1/4"), rest
    rows = {name: state for name, state, _ in slurm_grid.cell_states(tmp_path / "out")}
    assert rows[cell.name] == "not finished"  # its runner is gone


def _fake_nvidia_smi(tmp_path, monkeypatch, mib: int, name: str = "NVIDIA A100-SXM4-40GB") -> None:
    """nvidia-smi on PATH answering the queries of opsd.research.cell for every GPU id it is given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        ids=0; query=""
        while [ $# -gt 0 ]; do
          case "$1" in -i) ids="$2"; shift ;; --query-gpu=*) query="${{1#--query-gpu=}}" ;; esac; shift
        done
        for id in ${{ids//,/ }}; do
          case "$query" in
            name) echo "{name}" ;;
            index,name,memory.total) echo "$id, {name}, {mib}" ;;
            *) exit 6 ;;
          esac
        done
    """))
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")


def _paged_grid(tmp_path, **spec):
    """A grid of the real model (no tiny preset): its GPU cells evaluate with the paged engine."""
    grid_file = tmp_path / "paged.json"
    grid_file.write_text(json.dumps({"seeds": [0], "arms": {"entry": {}}, **spec}))
    grid = opsd.research.grid.load_grid(str(grid_file))
    return grid, opsd.research.grid.cells(grid, tmp_path / "out")


def test_a_gpu_cell_whose_card_cannot_hold_the_evaluations_pool_fails_before_training(tmp_path, monkeypatch):
    """The grid fixes the paged engine's KV pool at 32 GiB: on a 40 GB card the evaluation failed after
    the training's hours. The cell now fails first, with one line saying what to set."""
    monkeypatch.delenv("OPSD_EVAL_PAGED_GIB", raising=False)
    _fake_nvidia_smi(tmp_path, monkeypatch, mib=40960)
    grid, (cell,) = _paged_grid(tmp_path)
    outcome = grid_cell.run_cell(grid, cell, lambda message: None, gpus=("3",))
    assert outcome == ("failed: GPU 3 (NVIDIA A100-SXM4-40GB, 40.0 GiB) cannot hold the evaluation's paged KV pool "
                       "of 32 GiB and 6 GiB for the model (90% of it is usable); run the grid with "
                       "OPSD_EVAL_PAGED_GIB=30 (or less; every cell alike: the samples depend on it) or evaluate "
                       'with vLLM (eval_flags ["--backend", "vllm"])')
    assert not cell.folder.exists()  # nothing trained, nothing written
    # 0.9 x 40 GiB = 36 GiB holds a pool of 30 GiB and the margin; under SLURM (gpus None) every GPU listed.
    monkeypatch.setenv("OPSD_EVAL_PAGED_GIB", "30")
    assert grid_cell.eval_pool_problem(grid, None) is None
    monkeypatch.setenv("OPSD_EVAL_PAGED_GIB", "31")
    assert grid_cell.eval_pool_problem(grid, None).startswith("GPU 0 (NVIDIA A100-SXM4-40GB, 40.0 GiB) cannot hold")
    monkeypatch.delenv("OPSD_EVAL_PAGED_GIB")
    assert grid_cell.eval_pool_problem(grid, ()) is None  # a CPU cell
    big, _ = _paged_grid(tmp_path, eval_flags=["--paged-cache-gib", "8"])  # the grid's own pool fits
    assert grid_cell.eval_pool_gib(big) == 8.0 and grid_cell.eval_pool_problem(big, ("3",)) is None
    # Engines without the pool: vLLM, another transformers engine, the tiny preset's generate().
    for spec in ({"eval_flags": ["--backend", "vllm"]}, {"eval_flags": ["--engine", "dynamic"]}, {"preset": "tiny"}):
        other, _ = _paged_grid(tmp_path, **spec)
        assert grid_cell.eval_pool_gib(other) is None and grid_cell.eval_pool_problem(other, ("3",)) is None
    _fake_nvidia_smi(tmp_path, monkeypatch, mib=81559, name="NVIDIA H100 80GB HBM3")  # an 80 GB card holds it
    assert grid_cell.eval_pool_problem(grid, ("3",)) is None


def _no_flock(monkeypatch):
    """fcntl.flock as on Lustre mounted without -o flock."""
    import errno
    import fcntl

    def flock(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", flock)


def test_a_filesystem_without_file_locks_is_one_line_naming_it(tmp_path, monkeypatch):
    from opsd.run_folder import RunFolderError, RunLock, filesystem_of

    _no_flock(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    where = filesystem_of(str(out))
    with pytest.raises(opsd.research.grid.GridError) as refused:
        opsd.research.grid.GridLock(out)
    assert str(refused.value) == (
        f"cannot lock {out / '.grid.lock'}: Function not implemented on its filesystem ({where}); put --out on a "
        "filesystem with working file locks (a local disk, Lustre mounted with -o flock, NFS with its lock service)")
    # The cell lock flocks its folder to take over a stale lock: the same line, not a traceback.
    folder = tmp_path / "cell"
    folder.mkdir()
    (folder / ".lock").write_text(f"999999999 {socket.gethostname()} -\n")  # stale: no such process
    with pytest.raises(RunFolderError, match="^" + re.escape(f"cannot lock {folder}: Function not implemented on its "
                                                             f"filesystem ({where}); put the folder on a filesystem")):
        RunLock(str(folder)).acquire()


def test_a_grid_on_a_filesystem_without_file_locks_stops_with_one_line(tmp_path):
    grid_file, _, _ = _grid(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    patched = tmp_path / "sitecustomize.py"  # the grid process's fcntl.flock fails as on such a filesystem
    patched.write_text("import errno, fcntl\n"
                       "def flock(fd, operation):\n    raise OSError(errno.ENOSYS, 'Function not implemented')\n"
                       "fcntl.flock = flock\n")
    line = _only_error_line(run_grid(grid_file, out, env={"PYTHONPATH": str(tmp_path)}))
    assert line.startswith(f"error: cannot lock {out / '.grid.lock'}: Function not implemented on its filesystem (")
    assert line.endswith("; put --out on a filesystem with working file locks (a local disk, Lustre mounted with "
                         "-o flock, NFS with its lock service)")


def test_the_filesystem_of_a_path_is_its_longest_mount_point(tmp_path):
    from opsd.run_folder import filesystem_of

    mounts = tmp_path / "mounts"
    mounts.write_text("overlay / overlay rw 0 0\n10.0.0.1@tcp:/scratch /scratch lustre rw,localflock 0 0\n"
                      "server:/home/my\\040lab /home/my\\040lab nfs4 rw 0 0\n")
    assert filesystem_of("/scratch/me/grid", str(mounts)) == "lustre at /scratch"
    assert filesystem_of("/scratch2/grid", str(mounts)) == "overlay at /"
    assert filesystem_of("/home/my lab/grid", str(mounts)) == "nfs4 at /home/my lab"
    assert filesystem_of("/x", str(tmp_path / "none")) == "type unknown"


def test_a_grid_removes_its_lock_file_when_it_ends_and_a_leftover_file_stops_no_one(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with opsd.research.grid.GridLock(out):
        assert (out / ".grid.lock").is_file()
    assert not (out / ".grid.lock").exists()  # ended normally
    with pytest.raises(ValueError), opsd.research.grid.GridLock(out):
        raise ValueError("the grid failed")
    assert not (out / ".grid.lock").exists()  # ended on an error
    (out / ".grid.lock").write_text("PID 1 on a-node-killed-long-ago\n")  # a killed grid's file: no flock on it
    with opsd.research.grid.GridLock(out):
        assert (out / ".grid.lock").read_text() == f"PID {__import__('os').getpid()} on {socket.gethostname()}\n"
    # A grid run leaves none either, here one whose cells all fail at once (its snapshot has no code).
    grid_file, _, _ = _grid(tmp_path)
    (out / grid_cell.SNAPSHOT_DIR / grid_cell.code_version()).mkdir(parents=True)
    run = run_grid(grid_file, out, env={"CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 1 and "is gone; re-run the grid" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    assert not (out / ".grid.lock").exists()


def test_a_grid_that_locked_the_file_an_ending_grid_removed_takes_the_new_one(tmp_path, monkeypatch):
    """A grid that opened `.grid.lock` just before the running grid ended (removed it, dropped its
    flock) holds the flock of a removed file: it must not run beside the next grid, which locks a
    new file at the path. It checks that the file it locked is the one at the path, and tries again."""
    import fcntl
    import os

    out = tmp_path / "out"
    out.mkdir()
    real_flock, others = fcntl.flock, []

    def flock(fd, operation):  # between this grid's open and its flock: the old grid ends, a new one starts
        if not others:
            os.unlink(out / ".grid.lock")
            others.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
                import time
                from pathlib import Path
                from opsd.research.grid import GridLock
                with GridLock(Path({str(out)!r})):
                    print("held", flush=True)
                    time.sleep(60)
            """)], stdout=subprocess.PIPE, text=True, cwd=REPO))
            assert others[0].stdout.readline().strip() == "held"
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    (out / ".grid.lock").write_text("")  # the ending grid's file, opened by this grid
    try:
        with pytest.raises(opsd.research.grid.GridError) as refused:
            opsd.research.grid.GridLock(out)
    finally:
        for other in others:
            other.kill()
            other.wait()
    assert str(refused.value).startswith(f"another grid is running into {out} (PID {others[0].pid} on ")


def _tqdm_log(path: Path, steps: list[float], total: int = 100, start: int = 0) -> None:
    """What the trainer's tqdm bar writes to a cell's log (it runs tqdm itself, on a fake clock):
    each step's seconds in `steps`, the first one with the loading and compiling."""
    import io

    from tqdm import tqdm

    now, text = [0.0], io.StringIO()
    bar = tqdm(total=total, initial=start, file=text, mininterval=0, miniters=1, ascii=True)
    bar._time = lambda: now[0]
    bar.start_t = bar.last_print_t = 0.0
    for seconds in steps:
        now[0] += seconds
        bar.update(1)
    with open(path, "a") as f:
        f.write(text.getvalue())


def test_the_time_left_is_the_step_rate_after_the_first_step(tmp_path):
    """tqdm's own estimate starts from the first step, which carries the loading and compiling: at
    step 3 of 100 (50 s, then 2 s a step) it said 20:35, about 6x the 03:14 left."""
    log = tmp_path / "train.log"
    log.write_text("$ python opsd_train.py ...\n")
    _tqdm_log(log, [50.0])
    assert grid_cell.log_progress(log) == "1/100"  # one step: nothing measured yet
    _tqdm_log(log, [50.0, 2.0, 2.0])
    assert "3/100 [00:54<20:35" in log.read_text()  # what tqdm says
    assert grid_cell.log_progress(log) == "3/100, about 03:14 left"  # 97 steps x 2 s
    # A resumed run appends to the log after its command line: only its own steps count.
    with open(log, "a") as f:
        f.write("\n$ python opsd_train.py ...\n[OPSD] resuming from checkpoint-50\n")
    _tqdm_log(log, [40.0, 3.0, 3.0, 3.0], start=50)
    assert grid_cell.log_progress(log) == "54/100, about 02:18 left"  # 46 x 3 s
