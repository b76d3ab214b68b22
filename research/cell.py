"""One cell of a research grid: the grid file, its cells (arm x seed), the commands that train and
evaluate a cell, what a cell's results depend on (cell.json), and `run_cell`, which runs one.

research/grid.py runs the cells here or on a SLURM cluster (research/slurm_grid.py) and compares them.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from opsd.run_folder import write_text_atomic
from research import executors

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

    from evaluation import evaluate

    message = io.StringIO()
    try:
        with contextlib.redirect_stderr(message):
            evaluate.parse_args(["base", *flags])
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

def train_command(grid: Grid, cell: Cell, processes: int = 1, port: int | None = None) -> list[str]:
    """The cell's training: one process, or `processes` DDP processes (one per GPU of the cell)
    through accelerate on `port`; either way the grid's global batch."""
    b = grid.budget
    accumulation = b["global_batch"] // (b["per_device_batch"] * processes)
    if processes == 1:
        command = [sys.executable, str(REPO / "opsd_train.py")]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch",
                   "--config_file", str(REPO / "configs" / "ddp.yaml"), "--num_processes", str(processes),
                   "--main_process_port", str(port or 29500), str(REPO / "opsd_train.py")]
    if grid.preset:
        command += ["--preset", grid.preset]
    command += [
        "--recipe", str(cell.folder / "recipe.env"), "--output_dir", str(cell.folder / "run"),
        "--seed", str(cell.seed), "--max_steps", str(b["max_steps"]),
        "--per_device_train_batch_size", str(b["per_device_batch"]),
        "--gradient_accumulation_steps", str(accumulation),
        "--save_strategy", "steps", "--save_steps", str(save_every(grid)), "--report_to", "none",
        "--logging_steps", "1", *cell.arm.flags,
    ]
    return command


# The launcher's grace for a multi-GPU cell's processes once a SIGTERM stops the cell: they finish the
# step and write a checkpoint, then the launcher SIGKILLs them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, torch's
# default 30 s, less than a real step and save). Below research/slurm_grid.py's CHECKPOINT_WAIT_S, so
# that on SLURM the launcher, not SlurmCell.checkpoint's kill of the launcher alone, ends them.
LAUNCHER_GRACE_S = 90


def save_every(grid: Grid) -> int:
    """Checkpoint interval: the sweep's, else a quarter of the budget, so that an interrupted,
    preempted or timed-out cell resumes from at most a quarter back (resuming is exact)."""
    return grid.sweep_every or max(1, grid.budget["max_steps"] // 4)


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


def cell_identity(grid: Grid, cell: Cell) -> dict:
    """What a cell's results depend on, and nothing about where it ran: stored as the cell's
    cell.json, so that a grid folder never mixes the cells of two different grids."""
    identity = {"arm": cell.arm.name, "seed": cell.seed, "preset": grid.preset, "eval_data": grid.eval_data,
                "eval_flags": list(grid.eval_flags)}
    if cell.arm.train:
        identity.update(budget=grid.budget, sweep_every=grid.sweep_every, recipe={**grid.recipe, **cell.arm.recipe},
                        env=cell.arm.env, flags=list(cell.arm.flags))
    return identity


def check_cell_identity(grid: Grid, cell: Cell) -> None:
    """GridError when the cell's folder holds another grid's cell (its cell.json differs)."""
    path = cell.folder / "cell.json"
    if not path.is_file():
        return
    stored = json.loads(path.read_text(encoding="utf-8"))
    wanted = json.loads(json.dumps(cell_identity(grid, cell)))  # as JSON has it (tuples are lists)
    if stored != wanted:
        key = next(k for k in sorted(set(stored) | set(wanted)) if stored.get(k) != wanted.get(k))
        raise GridError(f"{cell.folder} holds the cell of another grid ({key}: {stored.get(key)!r} there, "
                        f"{wanted.get(key)!r} in this grid); use another --out, or delete that folder")


def devices_label(gpus: tuple[str, ...] | None) -> str:
    if gpus is None:
        return "this machine"
    return f"GPU {','.join(gpus)}" if gpus else "CPU"


def _ignore_usr2() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def run_cell(grid: Grid, cell: Cell, log, gpus: tuple[str, ...] | None = None, port: int | None = None,
             started=None) -> str:
    """Train (if needed) and evaluate one cell; returns 'done', 'skipped' or 'failed: ...'.

    gpus: the GPU ids the cell runs on (its CUDA_VISIBLE_DEVICES; () = CPU; None = whatever this
    process sees, as under SLURM, which sets it); several GPUs train as that many DDP processes on
    `port`. started(process) is told each child process, so that a SLURM job can stop it cleanly."""
    if cell.report.is_file():
        return "skipped"
    cell.folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(cell.folder / "cell.json", json.dumps(cell_identity(grid, cell), indent=1) + "\n")
    env = {**os.environ, **cell.arm.env, "PYTHONUNBUFFERED": "1",
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(LAUNCHER_GRACE_S)}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    steps = []
    if cell.arm.train:
        (cell.folder / "recipe.env").write_text(recipe_text(grid, cell.arm), encoding="utf-8")
        steps.append(("train", train_command(grid, cell, max(1, len(gpus or ())), port)))
    steps.append(("eval", eval_command(grid, cell)))
    for kind, command in steps:
        start = time.time()
        log(f"{cell.name}: {kind} on {devices_label(gpus)} ...")
        with open(cell.folder / f"{kind}.log", "a", encoding="utf-8") as out:
            where = f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} " if gpus is not None else ""
            start_line = "\n" if out.tell() else ""  # an interrupted run may have left a line unfinished
            out.write(f"{start_line}$ {where}{' '.join(command)}\n")
            out.flush()
            if started is None:
                status = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode
            else:
                # Under SLURM, SIGUSR2 is submitit's notice to the job (preemption, time limit): the
                # children ignore it and are stopped by SlurmCell.checkpoint with a SIGTERM instead.
                child = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                         preexec_fn=_ignore_usr2)
                started(child)
                while (status := child.poll()) is None:  # not wait(): the signal handler must be able to reap it
                    time.sleep(0.5)
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


def _check_processes_divide_batch(grid: Grid, processes: int) -> None:
    b = grid.budget
    if b["global_batch"] % (b["per_device_batch"] * processes):
        raise executors.ExecutorError(
            f"{processes} GPUs a cell: global_batch {b['global_batch']} is not a multiple of per_device_batch "
            f"{b['per_device_batch']} x {processes} processes")
