"""One cell of a research grid: the grid file, its cells (arm x seed), the commands that train and
evaluate a cell, what a cell's results depend on (cell.json), and `run_cell`, which runs one.

opsd/research/grid.py runs the cells here or on a SLURM cluster (opsd/research/slurm_grid.py) and compares them.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from opsd.research import executors
from opsd.run_folder import slurm_job_id, write_text_atomic

REPO = Path(__file__).resolve().parents[2]  # the repository (opsd/research/ -> root)
BUDGET_DEFAULT = {"max_steps": 100, "global_batch": 32, "per_device_batch": 4}
# The recipe a grid's arms start from (the grid file's "base_recipe"): what train_capped.sh runs by
# default (recipe.env, the fork's cosine schedule), or the released recipe. The grid's and the arm's
# recipe keys go on top of it.
BASE_RECIPES = {"shipped": "recipe.env", "released": "recipe.released.env"}


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
    base_recipe: str = "shipped"  # a key of BASE_RECIPES
    margin: float | None = None  # the equivalence margin in pass@1 points, stated before the run (results)
    compare_to: tuple[str, ...] = ()  # arms every arm is also compared with, beside the baseline (results)


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
    known = {"preset", "eval_data", "eval_flags", "sweep_every", "seeds", "budget", "recipe", "baseline", "arms",
             "base_recipe", "margin", "compare_to"}
    if unknown := sorted(set(spec) - known):
        raise GridError(f"{where}: unknown key {unknown[0]!r}; expected {', '.join(sorted(known))}")
    arms_spec = spec.get("arms")
    if not isinstance(arms_spec, dict) or not arms_spec:
        raise GridError(f"{where}: 'arms' must be a non-empty object of arm name -> settings")
    switches = set(SWITCH_VARIABLES.values())
    arms = []
    for name, value in arms_spec.items():
        if not isinstance(value, dict):
            raise GridError(f"{where}: arm {name!r} must be an object with train / recipe / env / flags")
        if unknown := sorted(set(value) - {"train", "recipe", "env", "flags"}):
            raise GridError(f"{where}: arm {name!r}: unknown key {unknown[0]!r}; expected env, flags, recipe, train")
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
        raise GridError(f"{where}: 'eval_flags' must be a list of strings (python -m opsd.evaluation's flags)")
    _check_eval_flags(eval_flags, where)
    sweep_every = spec.get("sweep_every")
    if sweep_every is not None and not (isinstance(sweep_every, int) and not isinstance(sweep_every, bool)
                                        and 0 < sweep_every <= budget["max_steps"]):
        raise GridError(f"{where}: 'sweep_every' must be a whole number of steps from 1 to max_steps "
                        f"({budget['max_steps']}), got {sweep_every!r}")
    base_recipe = spec.get("base_recipe", "shipped")
    if base_recipe not in BASE_RECIPES:
        raise GridError(f"{where}: 'base_recipe' must be one of {', '.join(map(repr, BASE_RECIPES))} "
                        f"({', '.join(BASE_RECIPES.values())}), got {base_recipe!r}")
    margin, compare_to = _check_margin(spec, where), _check_compare_to(spec, arms, baseline, where)
    grid = Grid(tuple(arms), tuple(seeds), spec.get("eval_data"), spec.get("preset"), budget,
                dict(spec.get("recipe", {})), baseline, tuple(eval_flags), sweep_every, base_recipe, margin,
                compare_to)
    for arm in grid.arms:  # a recipe error surfaces now, with the arm's name, not after hours of training
        _check_recipe(recipe_text(grid, arm), f"{where}: arm {arm.name!r}")
    return grid


def _check_margin(spec: dict, where: str) -> float | None:
    """The grid file's `margin`: points > 0 on the pass@1 scale, or absent (no equivalence claim)."""
    margin = spec.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not 0 < margin < float("inf")):
        raise GridError(f"{where}: 'margin' must be a number of points > 0 (the equivalence margin on the pass@1 "
                        f"scale), got {margin!r}")
    return None if margin is None else float(margin)


def _check_compare_to(spec: dict, arms: list[Arm], baseline: str, where: str) -> tuple[str, ...]:
    """The grid file's `compare_to`: arms other than the baseline, each once."""
    names = spec.get("compare_to", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise GridError(f"{where}: 'compare_to' must be a list of arm names, got {names!r}")
    for name in names:
        if name not in {a.name for a in arms}:
            raise GridError(f"{where}: compare_to {name!r} is not an arm ({', '.join(a.name for a in arms)})")
        if name == baseline:
            raise GridError(f"{where}: compare_to {name!r} is the baseline, which every arm is compared with already")
        if names.count(name) > 1:
            raise GridError(f"{where}: compare_to names {name!r} twice")
    return tuple(names)


def _check_eval_flags(flags: list[str], where: str) -> None:
    """The evaluation's own parser on the flags, so that a wrong one stops the grid now, not after training."""
    import contextlib
    import io

    from opsd.evaluation import evaluate

    message = io.StringIO()
    try:
        with contextlib.redirect_stderr(message):
            evaluate.parse_args(["base", *flags])
    except SystemExit:
        last = (message.getvalue().strip().splitlines() or ["not valid"])[-1]
        raise GridError(f"{where}: eval_flags {' '.join(flags)!r}: {last.split('error: ', 1)[-1]}") from None


def base_recipe_keys(grid: Grid, repo: Path = REPO) -> dict[str, str]:
    """The keys the grid's base recipe file sets (`recipe.env`: lr_scheduler_type=cosine; the
    released recipe: none), as the file writes them."""
    from opsd.config import recipe_overrides

    return recipe_overrides(repo / BASE_RECIPES[grid.base_recipe])


def cell_recipe(grid: Grid, arm: Arm) -> dict:
    """An arm's recipe keys: its grid's base recipe, then the grid's `recipe`, then the arm's own."""
    return {**base_recipe_keys(grid), **grid.recipe, **arm.recipe}


def recipe_text(grid: Grid, arm: Arm) -> str:
    return "".join(f"{key}={_recipe_value(value)}\n" for key, value in cell_recipe(grid, arm).items())


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

def train_command(grid: Grid, cell: Cell, processes: int = 1, port: int | None = None,
                  code_dir: Path = REPO) -> list[str]:
    """The cell's training: one process, or `processes` DDP processes (one per GPU of the cell)
    through accelerate on `port`; either way the grid's global batch. `code_dir`: the code that runs
    (the grid's snapshot, `snapshot_code`; by default this checkout)."""
    b = grid.budget
    accumulation = b["global_batch"] // (b["per_device_batch"] * processes)
    if processes == 1:
        command = [sys.executable, str(code_dir / "opsd_train.py")]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch",
                   "--config_file", str(code_dir / "configs" / "ddp.yaml"), "--num_processes", str(processes),
                   "--main_process_port", str(port or 29500), str(code_dir / "opsd_train.py")]
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


# The launcher's grace for a multi-GPU cell's ranks when a SIGTERM reaches the launcher itself (a scancel,
# a preemption without the user signal): they finish the step and write a checkpoint, then the launcher
# SIGKILLs them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT; torch 2.13 honours it, torch 2.11, the GPU stack's pin,
# kills after 30 s whatever it says: docs/MULTI_GPU.md "Stopping"). A grid's own stop before a requeue
# signals the ranks, not the launcher (opsd/research/slurm_grid.py), so no countdown starts there.
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
    command = [sys.executable, "-m", "opsd.evaluation", checkpoint, "--output-dir", str(cell.folder / "eval")]
    if grid.preset:
        command += ["--preset", grid.preset]
    if grid.eval_data:
        command += ["--dataset", grid.eval_data]
    return command + list(grid.eval_flags)


# The paged evaluation engine's KV pool, in GiB, for every cell of a grid (OPSD_EVAL_PAGED_GIB, which
# `python -m opsd.evaluation` reads): fixed here, not half of whichever GPU a cell lands on, because the
# samples depend on it (the pool shapes the schedule). The grid's environment, or its eval_flags'
# --paged-cache-gib, sets another. Engines other than paged (the tiny preset's, vLLM) ignore it.
EVAL_PAGED_GIB = "32"


def eval_environment(environ=os.environ) -> dict[str, str]:
    """The variables a cell's evaluation gets from the grid: the paged KV pool (EVAL_PAGED_GIB)."""
    return {"OPSD_EVAL_PAGED_GIB": environ.get("OPSD_EVAL_PAGED_GIB") or EVAL_PAGED_GIB}


def inherited_variables(cell: Cell, environ=os.environ) -> dict[str, str]:
    """The OPSD_* variables a cell inherits from the grid's environment (its arm's own `env` aside):
    switches, data, the evaluation's pool; they change what the cell computes."""
    return {key: value for key, value in sorted(environ.items())
            if key.startswith("OPSD_") and key not in cell.arm.env}


def cell_identity(grid: Grid, cell: Cell, processes: int = 1, environ=os.environ) -> dict:
    """What a cell's results depend on: stored in the cell's cell.json and compared on every re-run,
    so that a grid folder never mixes the cells of two different grids, and a cell never resumes at
    another process count (which splits the global batch differently) or with other variables.
    Where it ran (host, GPU, job) and the code version are recorded beside it (`provenance`)."""
    identity = {"arm": cell.arm.name, "seed": cell.seed, "preset": grid.preset, "eval_data": grid.eval_data,
                "eval_flags": list(grid.eval_flags),
                "variables": {**inherited_variables(cell, environ), **eval_environment(environ)}}
    if cell.arm.train:
        identity.update(budget=grid.budget, sweep_every=grid.sweep_every, recipe=cell_recipe(grid, cell.arm),
                        env=cell.arm.env, flags=list(cell.arm.flags), processes=processes)
    return identity


def check_cell_identity(grid: Grid, cell: Cell, processes: int = 1, environ=os.environ) -> None:
    """GridError when the cell's folder holds a cell of other settings (its cell.json differs). A key
    that a cell.json written by an older version lacks is not compared."""
    stored = _read_cell_json(cell)
    if stored is None:
        return
    wanted = json.loads(json.dumps(cell_identity(grid, cell, processes, environ)))  # as JSON has it
    for key in sorted(wanted):
        if key in stored and stored[key] != wanted[key]:
            there, here = stored[key], wanted[key]
            if isinstance(there, dict) and isinstance(here, dict):  # name the one entry that differs
                inner = next(k for k in sorted(set(there) | set(here)) if there.get(k) != here.get(k))
                key, there, here = f"{key}.{inner}", there.get(inner), here.get(inner)
            hint = ("--gpus-per-cell as it was" if key == "processes" else
                    "the environment it ran with" if key.startswith("variables") else None)
            raise GridError(f"{cell.folder} holds a cell of other settings ({key}: {there!r} there, {here!r} now); "
                            + (f"re-run with {hint}, " if hint else "") + "use another --out, or delete that folder")


def _read_cell_json(cell: Cell) -> dict | None:
    path = cell.folder / "cell.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise GridError(f"{path}: not readable JSON ({exc}); delete that cell folder to run it again") from None


# --------------------------------------------------------------------------
# The code a cell runs
# --------------------------------------------------------------------------

# What counts as code for a cell's version: the tracked files a run executes or reads as settings
# (not the docs: editing a note while a grid runs changes no result).
CODE_FILES = ("*.py", "*.sh", "*.env", "*.json", "*.yaml", "*.toml", "*.txt", "*.ini")
# Where a grid keeps its code snapshots, in its --out: a hidden folder, so that no scan of the
# package tree (a grid written under the checkout's outputs/, then the suite) finds its copy of opsd/.
SNAPSHOT_DIR = ".code"
OLD_SNAPSHOT_DIR = "code"  # the folder before; a grid folder that holds the version there reuses it
SNAPSHOT_SKIPS = ("tests/", "docs/", "grids/results/")  # what no cell runs or reads
# Never part of a copy's files, whatever its .gitignore says (a virtual environment, a grid's snapshots).
WALK_SKIPS = (".git", ".venv", "venv", SNAPSHOT_DIR)


def own_checkout(repo: Path = REPO) -> bool:
    """Whether `repo` is the top level of a git checkout of its own: not a copy without git (an
    unpacked `git archive`), and not a copy inside another repository (a monorepo, a home folder
    kept in git), whose commit and files are not this code's."""
    try:
        top = subprocess.run(["git", "-C", str(repo), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return top.returncode == 0 and Path(top.stdout.strip()).resolve() == Path(repo).resolve()


def repository_files(repo: Path = REPO, untracked: bool = False) -> list[str]:
    """The checkout's files (paths relative to `repo`, sorted): in its own git checkout the tracked
    ones (`untracked`: and the untracked ones git does not ignore); in a copy, every file but those
    its .gitignore names and WALK_SKIPS, and no grid folder (one holding a snapshot). Never what a
    run wrote under outputs/ or runs/. An installed package (REPO is then site-packages, without the
    repository's pyproject.toml) has none: its grids run it where it is, unversioned."""
    if not own_checkout(repo):
        return _walk_files(Path(repo)) if (Path(repo) / "pyproject.toml").is_file() else []
    extra = ["--others", "--exclude-standard"] if untracked else []
    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", *extra], capture_output=True,
                            timeout=60, check=True).stdout.decode()
    return sorted({name for name in listed.split("\0") if name and (Path(repo) / name).is_file()})


def _walk_files(repo: Path) -> list[str]:
    patterns = _ignore_patterns(repo)
    found = []
    for folder, dirs, names in os.walk(repo):
        base = Path(folder).relative_to(repo)
        dirs[:] = [d for d in dirs if d not in WALK_SKIPS and not _ignored(base / d, True, patterns)
                   and not (Path(folder) / d / SNAPSHOT_DIR).is_dir()]
        found += [(base / n).as_posix() for n in names
                  if not _ignored(base / n, False, patterns) and (Path(folder) / n).is_file()]
    return sorted(found)


def _ignore_patterns(repo: Path) -> list[str]:
    """The top-level .gitignore's patterns (the repository's one; negations are not read)."""
    try:
        lines = (repo / ".gitignore").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    return [line.strip() for line in lines if line.strip() and not line.startswith(("#", "!"))]


def _ignored(path: Path, is_dir: bool, patterns: list[str]) -> bool:
    """git's rule for one pattern: `name/` only folders; a pattern with a `/` from the top, else any depth."""
    for pattern in patterns:
        if pattern.endswith("/") and not is_dir:
            continue
        pattern = pattern.rstrip("/")
        if fnmatch.fnmatchcase(path.as_posix() if "/" in pattern else path.name, pattern.lstrip("/")):
            return True
    return False


def snapshot_files(repo: Path = REPO) -> list[str]:
    """What a snapshot copies: the checkout's files (`repository_files`, untracked ones git does not
    ignore included: a module written but not yet added runs in the cells) but tests, docs and pictures."""
    return [name for name in repository_files(repo, untracked=True)
            if not name.startswith(SNAPSHOT_SKIPS) and not name.endswith((".md", ".png"))]


def code_version(repo: Path = REPO) -> str | None:
    """The checkout's version: its commit, with `+dirty-<hash>` when its code files (CODE_FILES)
    differ from it: tracked ones edited, or untracked ones git does not ignore (a new module not yet
    added), which the snapshot copies too (the hash of the difference and of those files: the same
    edits give the same version). A copy that is not its own git checkout (`own_checkout`):
    `content-<hash>` of the code files its snapshot holds, paths and bytes. None: no code there."""
    if not own_checkout(repo):
        return _content_version(repo)
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, timeout=60)
        if head.returncode != 0:  # a repository without a commit yet
            return _content_version(repo)
        diff = subprocess.run(["git", "-C", str(repo), "diff", "HEAD", "--binary", "--", *CODE_FILES],
                              capture_output=True, timeout=60).stdout
        new = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--others", "--exclude-standard", "--",
                              *CODE_FILES], capture_output=True, timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):
        return _content_version(repo)
    commit = head.stdout.decode().strip()[:12]
    new = sorted(name for name in new if name and (Path(repo) / name).is_file())
    if not diff and not new:
        return commit
    digest = hashlib.sha256(diff)
    for name in new:
        data = (Path(repo) / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return f"{commit}+dirty-{digest.hexdigest()[:12]}"


def _content_version(repo: Path) -> str | None:
    digest = hashlib.sha256()
    names = [n for n in snapshot_files(repo) if any(fnmatch.fnmatchcase(Path(n).name, p) for p in CODE_FILES)]
    for name in names:
        data = (Path(repo) / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return f"content-{digest.hexdigest()[:12]}" if names else None


def check_cell_code(cell: Cell, code: str | None, allow_change: bool = False) -> None:
    """GridError when a started, unfinished cell ran on other code than the checkout's now: resuming
    it would mix two versions in one result (`--allow-code-change` resumes it all the same)."""
    stored = _read_cell_json(cell) or {}
    ran = (stored.get("provenance") or {}).get("code")
    if allow_change or cell.report.is_file() or code is None or ran in (None, code):
        return
    started = any((cell.folder / "run").glob("checkpoint-*")) or any((cell.folder / "eval").glob("*.partial.jsonl"))
    if started:
        raise GridError(f"{cell.name} started on code {ran}, the checkout is now {code}: resuming it would mix the "
                        "two; re-run with --allow-code-change to resume it anyway, or delete its folder to restart it")


def snapshot_code(out: Path, repo: Path = REPO) -> tuple[str | None, Path]:
    """The code a grid's cells run: a copy of the checkout's files (`snapshot_files`: tracked ones as
    they are now, uncommitted edits included; tests, docs and pictures left out) at their
    repository paths in `out`/.code/<version>/ (SNAPSHOT_DIR), made once per version; a grid
    folder that holds the version in its old place, `out`/code/<version>/, keeps using it. A cell's
    training and evaluation run from it (their working folder; the snapshot's packages come before
    the installed ones on the import path), so that editing or pulling the checkout while a grid
    runs, or while its jobs wait in a SLURM queue, changes none of its cells. Returns (version,
    folder); (None, the checkout itself) where there is no code to copy."""
    version = code_version(repo)
    if version is None:
        return None, repo
    for place in (SNAPSHOT_DIR, OLD_SNAPSHOT_DIR):
        if (out / place / version).is_dir():  # made whole (renamed into place), so complete
            return version, out / place / version
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".code-"))
    for name in snapshot_files(repo):
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(repo) / name, tmp / name)
    folder = out / SNAPSHOT_DIR / version
    folder.parent.mkdir(exist_ok=True)
    os.replace(tmp, folder)
    return version, folder


def _query_gpus(gpus: tuple[str, ...] | None, fields: str) -> list[list[str]] | None:
    """nvidia-smi's `fields` (comma-separated) of each of `gpus` (None: every GPU it lists), one list
    a GPU; None when it cannot say (no nvidia-smi, no driver, an unknown id)."""
    command = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    try:
        found = subprocess.run(command + (["-i", ",".join(gpus)] if gpus else []), capture_output=True, text=True,
                               timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[value.strip() for value in line.split(",")] for line in found.stdout.splitlines() if line.strip()]
    return rows if found.returncode == 0 and rows and all(len(r) == fields.count(",") + 1 for r in rows) else None


def gpu_names(gpus: tuple[str, ...] | None) -> str:
    """What a cell's devices are, for its provenance: the GPUs' names from nvidia-smi, or 'CPU'."""
    if gpus == ():
        return "CPU"
    rows = _query_gpus(gpus, "name")
    return ", ".join(row[0] for row in rows) if rows else ("unknown" if gpus else "CPU")


# What a card must hold beside the evaluation's paged KV pool (the check before a GPU cell trains): the
# model's weights (Qwen3-1.7B in bf16: 3.2 GiB), the engine's buffers and CUDA's own memory. A margin,
# not a measurement: the engine checks the real need when the evaluation starts (MAX_MEMORY_SHARE).
EVAL_POOL_MARGIN_GIB = 6.0


def eval_pool_gib(grid: Grid, environ=os.environ) -> float | None:
    """The paged KV pool a GPU cell's evaluation takes, in GiB: --paged-cache-gib of the grid's
    eval_flags, else its OPSD_EVAL_PAGED_GIB (`eval_environment`); None when the evaluation on a GPU
    runs another engine (the tiny preset's generate(), vLLM: `--backend vllm`, or `auto` where vLLM
    is installed) or the variable is not a number (the evaluation says so itself)."""
    from opsd.evaluation import evaluate
    from opsd.rollout.vllm_backend import vllm_available

    args = evaluate.parse_args(["base", *(["--preset", grid.preset] if grid.preset else []), *grid.eval_flags])
    if args.backend == "vllm" or args.backend == "auto" and vllm_available():
        return None
    engine = args.engine if args.engine != "auto" else (
        evaluate.TINY_ENGINE if args.preset == evaluate.TINY else evaluate.ENGINE_AUTO["cuda"])
    if engine != "paged":
        return None
    try:
        return args.paged_cache_gib or float(eval_environment(environ)["OPSD_EVAL_PAGED_GIB"])
    except ValueError:
        return None


def eval_pool_problem(grid: Grid, gpus: tuple[str, ...] | None, environ=os.environ) -> str | None:
    """One line when a GPU the cell got cannot hold its evaluation's paged KV pool (`eval_pool_gib`)
    and EVAL_POOL_MARGIN_GIB within the share of its memory the engine may take (MAX_MEMORY_SHARE),
    said before the cell trains: the evaluation would fail after the training's hours. None when
    it fits, for CPU cells and other engines, and where nvidia-smi cannot say."""
    if gpus == () or (pool := eval_pool_gib(grid, environ)) is None:
        return None
    from opsd.rollout.paged_decode import MAX_MEMORY_SHARE

    for index, name, mib in _query_gpus(gpus, "index,name,memory.total") or []:
        try:
            usable = MAX_MEMORY_SHARE * float(mib) / 1024
        except ValueError:  # "[N/A]"
            continue
        if pool + EVAL_POOL_MARGIN_GIB > usable:
            most = max(1, int(usable - EVAL_POOL_MARGIN_GIB))
            return (f"GPU {index} ({name}, {float(mib) / 1024:.1f} GiB) cannot hold the evaluation's paged KV pool of "
                    f"{pool:g} GiB and {EVAL_POOL_MARGIN_GIB:g} GiB for the model ({MAX_MEMORY_SHARE:.0%} of it is "
                    f"usable); run the grid with OPSD_EVAL_PAGED_GIB={most} (or less; every cell alike: the samples "
                    "depend on it) or evaluate with vLLM (eval_flags [\"--backend\", \"vllm\"])")
    return None


def devices_label(gpus: tuple[str, ...] | None) -> str:
    if gpus is None:
        return "this machine"
    return f"GPU {','.join(gpus)}" if gpus else "CPU"


def _ignore_usr2() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


# --------------------------------------------------------------------------
# Progress: what a running step's log says
# --------------------------------------------------------------------------

_PROGRESS = re.compile(r"(\d+)/(\d+) \[(\d[\d:]*)<")


def log_progress(path: Path) -> str | None:
    """The last progress bar of a training or evaluation log ('k/N, about m:ss left'), None before the
    first. The time left is the rate of the steps after the bar's first one (which carries the
    loading and compiling: tqdm's own estimate, an average that starts from it, was about 5x too long
    at first), so it is said from the second step of the bar on. Only the log's last run counts (a
    resumed step appends to its log after a `$ command` line)."""
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None
    bars = [(int(done), int(total), _seconds(elapsed)) for done, total, elapsed in
            _PROGRESS.findall(text[text.rfind("\n$ ") + 1:])]
    if not bars:
        return None
    done, total, elapsed = bars[-1]
    series = [bars[-1]]  # the last bar's own run: the same total, counting up
    for bar in reversed(bars[:-1]):
        if bar[1] != total or bar[0] > series[0][0] or bar[2] > series[0][2]:
            break
        series.insert(0, bar)
    measured = next((bar for bar in series if bar[0] > series[0][0]), None)  # the end of its first step
    if measured is None or done <= measured[0]:
        return f"{done}/{total}"
    from tqdm import tqdm

    left = (total - done) * (elapsed - measured[2]) / (done - measured[0])
    return f"{done}/{total}, about {tqdm.format_interval(left)} left"


def _seconds(clock: str) -> int:
    """tqdm's elapsed time ('01:02', '1:02:03') in seconds."""
    seconds = 0
    for part in clock.split(":"):
        seconds = 60 * seconds + int(part)
    return seconds


PROGRESS_EVERY_S = 30.0  # how often a running cell's progress line is printed (when it changed)


def run_cell(grid: Grid, cell: Cell, log, gpus: tuple[str, ...] | None = None, port: int | None = None,
             started=None, code: str | None = None, code_dir: Path = REPO,
             progress_every: float = PROGRESS_EVERY_S, cells_per_gpu: int | None = None) -> str:
    """Train (if needed) and evaluate one cell; returns 'done', 'skipped' or 'failed: ...'.

    gpus: the GPU ids the cell runs on (its CUDA_VISIBLE_DEVICES; () = CPU; None = whatever this
    process sees, as under SLURM, which sets it); several GPUs train as that many DDP processes on
    `port` (default: a free one). started(process) is told each child process, so that a SLURM job
    can stop it cleanly. `code_dir`, `code`: the code the cell runs (the grid's snapshot) and its
    version, recorded in cell.json. The cell's folder is locked while it runs: a second runner of
    the same cell (another grid on the same --out, a resubmitted job) is refused. Each step's wall time
    goes to the cell's timing.json (`record_time`; `cells_per_gpu`: how many cells the grid let share
    the cell's GPU, None where unknown)."""
    from opsd.run_folder import RunFolderError, RunLock

    if cell.report.is_file():
        return "skipped"
    if not (code_dir / "opsd_train.py").is_file():
        return f"failed: the grid's code snapshot {code_dir} is gone; re-run the grid to make it again"
    if problem := eval_pool_problem(grid, gpus):  # before the training's hours, not after them
        return f"failed: {problem}"
    cell.folder.mkdir(parents=True, exist_ok=True)
    try:
        with RunLock(str(cell.folder)):
            return _run_cell_locked(grid, cell, log, gpus, port, started, code, code_dir, progress_every,
                                    cells_per_gpu)
    except RunFolderError as exc:
        return f"failed: {exc}"


TIMING_FILE = "timing.json"  # a cell's wall time per step: opsd.research.grid's results read it


def record_time(cell: Cell, kind: str, seconds: float, resumed: bool, cells_per_gpu: int | None) -> None:
    """Add one finished step's wall time to the cell's timing.json: `{kind}_s` (seconds, the process's
    start to its end: loading, compiling and checkpoints included), `{kind}_resumed` (the step
    continued an interrupted one, so its time is only the last part) and `cells_per_gpu` (cells the
    grid let share the GPU: above 1, the time is not a dedicated GPU's). A step run again replaces
    its entry."""
    path = cell.folder / TIMING_FILE
    try:
        timing = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        timing = {}
    timing = timing if isinstance(timing, dict) else {}
    timing.update({f"{kind}_s": round(seconds, 1), f"{kind}_resumed": resumed, "cells_per_gpu": cells_per_gpu})
    write_text_atomic(path, json.dumps(timing, indent=1) + "\n")


def _step_started_before(cell: Cell, kind: str) -> bool:
    """Whether a step finds an interrupted run of itself to continue: a checkpoint, a partial
    evaluation, or (a sweep) checkpoints already evaluated."""
    if kind == "train":
        return any((cell.folder / "run").glob("checkpoint-*"))
    return any((cell.folder / "eval").glob("*.partial.jsonl")) or any((cell.folder / "eval").glob("eval_*.json"))


def _run_cell_locked(grid, cell, log, gpus, port, started, code, code_dir, progress_every, cells_per_gpu) -> str:
    from opsd.tiny_default.cache import cache_dir

    processes = max(1, len(gpus or ()))
    provenance = {"code": code, "host": socket.gethostname(), "devices": gpu_names(gpus),
                  "slurm_job": slurm_job_id(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_text_atomic(cell.folder / "cell.json", json.dumps(
        {**cell_identity(grid, cell, processes), "provenance": provenance}, indent=1) + "\n")
    env = {**os.environ, **cell.arm.env, **eval_environment(), "PYTHONUNBUFFERED": "1",
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(LAUNCHER_GRACE_S),
           "OPSD_CACHE": str(cache_dir())}  # the embedded default's build cache: one for every snapshot
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    steps = []
    if cell.arm.train:
        (cell.folder / "recipe.env").write_text(recipe_text(grid, cell.arm), encoding="utf-8")
        if processes > 1 and port is None:
            port = executors.free_port()
        steps.append(("train", train_command(grid, cell, processes, port, code_dir)))
    steps.append(("eval", eval_command(grid, cell)))
    for kind, command in steps:
        start, resumed = time.time(), _step_started_before(cell, kind)
        log_path = cell.folder / f"{kind}.log"
        log(f"{cell.name}: {kind} on {devices_label(gpus)} ... (log: {log_path})")
        with open(log_path, "a", encoding="utf-8") as out:
            where = f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} " if gpus is not None else ""
            start_line = "\n" if out.tell() else ""  # an interrupted run may have left a line unfinished
            out.write(f"{start_line}$ {where}{' '.join(command)}\n")
            out.flush()
            # Under SLURM, SIGUSR2 is submitit's notice to the job (preemption, time limit): the
            # children ignore it and are stopped by SlurmCell.checkpoint with a SIGTERM instead.
            child = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=code_dir,
                                     preexec_fn=_ignore_usr2 if started is not None else None)
            if started is not None:
                started(child)
            said, next_report = None, time.time() + progress_every
            while (status := child.poll()) is None:  # not wait(): a signal handler must be able to reap it
                time.sleep(0.5)
                if time.time() >= next_report:
                    next_report = time.time() + progress_every
                    now = log_progress(log_path)
                    if now and now != said:
                        log(f"{cell.name}: {kind} {now}")
                        said = now
        if status != 0:
            return f"failed: {kind} exited {status} (see {log_path})"
        seconds = time.time() - start
        record_time(cell, kind, seconds, resumed, cells_per_gpu)
        log(f"{cell.name}: {kind} done in {seconds:.0f} s")
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
