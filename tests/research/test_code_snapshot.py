"""The code a grid runs, from any copy of the repository: its version and snapshot come from the
copy's own files (not from a git repository around it), and nothing a run writes into the copy
breaks the suite. Each failed before its fix (issue 61 item 1, issue 60 item 1)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from opsd.research import cell as grid_cell

REPO = Path(__file__).resolve().parents[2]
GIT = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]


def _unpacked_archive(dest: Path) -> Path:
    """`git archive | tar x` of this checkout into `dest`, its uncommitted edits included (`git stash
    create` makes a commit of them and changes nothing); from a copy that is not a git checkout, its files."""
    dest.mkdir(parents=True)
    if not grid_cell.own_checkout(REPO):
        for name in grid_cell.repository_files(REPO):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
        return dest
    tree = subprocess.run(["git", "-C", str(REPO), "stash", "create"], capture_output=True, text=True,
                          check=True).stdout.strip() or "HEAD"
    archive = subprocess.run(["git", "-C", str(REPO), "archive", tree], capture_output=True, check=True).stdout
    subprocess.run(["tar", "x", "-C", str(dest)], input=archive, check=True)
    return dest


def _git_repository(folder: Path) -> str:
    """A git repository of `folder`'s files with one commit; returns the commit."""
    subprocess.run([*GIT, "-C", str(folder), "init", "-q"], check=True)
    subprocess.run([*GIT, "-C", str(folder), "add", "."], check=True)
    subprocess.run([*GIT, "-C", str(folder), "commit", "-qm", "c"], check=True)
    return subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _home(tmp_path) -> tuple[Path, str]:
    """A home folder kept in git (a repository with one commit of its own)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("export A=1\n")
    return home, _git_repository(home)


def test_a_copy_inside_another_repository_has_its_own_files_and_a_content_version(tmp_path):
    home, commit = _home(tmp_path)
    copy = _unpacked_archive(home / "src" / "opsd")
    tracked = grid_cell.repository_files(REPO)  # what the archive holds
    assert not grid_cell.own_checkout(copy)
    assert grid_cell.repository_files(copy) == tracked  # the copy's files: the archive's, not the home's
    version = grid_cell.code_version(copy)
    assert version.startswith("content-") and len(version) == len("content-") + 12 and commit[:12] not in version
    # What runs write, caches and environments are not the copy's files, nor part of its version.
    for junk in ("outputs/g/entry/seed-0/cell.json", "runs/x/config.json", "opsd/__pycache__/cell.cpython.pyc",
                 ".cache/opsd/tiny.json", ".venv/lib/site.py", "built.egg-info/PKG-INFO",
                 "my-grid/.code/content-0/opsd/__init__.py", "my-grid/entry/seed-0/cell.json"):
        (copy / junk).parent.mkdir(parents=True, exist_ok=True)
        (copy / junk).write_text("{}\n")
    assert grid_cell.code_version(copy) == version
    assert grid_cell.repository_files(copy) == tracked
    # Committed into the repository around it (a monorepo), it is still its own version, not that commit.
    subprocess.run([*GIT, "-C", str(home), "add", "src"], check=True)
    subprocess.run([*GIT, "-C", str(home), "commit", "-qm", "vendored"], check=True)
    assert grid_cell.code_version(copy) == version
    # An edited code file is another version; the snapshot holds the copy's files as they are.
    with open(copy / "opsd" / "config.py", "a") as f:
        f.write("# edited\n")
    edited, folder = grid_cell.snapshot_code(tmp_path, copy)
    assert edited.startswith("content-") and edited != version and folder == tmp_path / ".code" / edited
    assert (folder / "opsd" / "config.py").read_text() == (copy / "opsd" / "config.py").read_text()
    assert (folder / "opsd_train.py").is_file() and not (folder / "tests").exists()
    assert not (folder / "outputs").exists() and not (folder / "my-grid").exists()


@pytest.mark.slow
def test_a_grid_runs_from_an_unpacked_archive_inside_another_git_repository(tmp_path):
    """Before: the grid took the home repository's commit as its version, its snapshot was empty
    (`git ls-files` lists no file of an untracked folder) and every cell failed with "the grid's
    code snapshot ... is gone". The copy's own files run: the grid's and the snapshot's."""
    home, commit = _home(tmp_path)
    copy = _unpacked_archive(home / "src" / "opsd")
    imported = tmp_path / "imported.txt"
    with open(copy / "opsd" / "__init__.py", "a") as f:  # each process that imports opsd says from where
        f.write("\nif __import__('os').environ.get('SNAPSHOT_TEST_IMPORTS'):\n"
                "    with open(__import__('os').environ['SNAPSHOT_TEST_IMPORTS'], 'a') as _marker:\n"
                "        _marker.write(__file__ + '\\n')\n")
    grid_file = tmp_path / "grid.json"
    grid_file.write_text(json.dumps({"preset": "tiny", "eval_data": "tiny:5:2", "seeds": [0], "arms": {"entry": {}},
                                     "budget": {"max_steps": 2, "global_batch": 2, "per_device_batch": 2}}))
    out = copy / "outputs" / "grid"
    run = subprocess.run([sys.executable, "-m", "opsd.research.grid", str(grid_file), "--out", str(out)],
                         capture_output=True, text=True, cwd=copy, timeout=900,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "SNAPSHOT_TEST_IMPORTS": str(imported)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (out / "entry" / "seed-0" / "eval.json").is_file()
    code = json.loads((out / "entry" / "seed-0" / "cell.json").read_text())["provenance"]["code"]
    assert code == grid_cell.code_version(copy) and code.startswith("content-") and commit[:12] not in code
    snapshot = out / ".code" / code
    assert f" {snapshot / 'opsd_train.py'} " in (out / "entry" / "seed-0" / "train.log").read_text()
    where = set(imported.read_text().splitlines())
    assert str(copy / "opsd" / "__init__.py") in where  # the grid: the copy's own package, not the installed one
    assert str(snapshot / "opsd" / "__init__.py") in where  # the training and the evaluation: the snapshot's
    assert where <= {str(copy / "opsd" / "__init__.py"), str(snapshot / "opsd" / "__init__.py")}


@pytest.mark.parametrize("kind", ["clone", "unpacked archive"])
def test_a_grid_written_into_the_checkouts_outputs_breaks_no_test(tmp_path, kind):
    """Before: quickstart.sh's grid left its snapshot (a copy of opsd/) in outputs/quickstart-cpu/code/,
    and the tests that scan the tree (test_house, test_imports) found it and failed."""
    copy = _unpacked_archive(tmp_path / "opsd")
    if kind == "clone":
        _git_repository(copy)
    out = copy / "outputs" / "quickstart-cpu"
    out.mkdir(parents=True)
    version, folder = grid_cell.snapshot_code(out, copy)  # what the grid makes when its cells start
    assert folder == out / ".code" / version and (folder / "opsd" / "__init__.py").is_file()
    shutil.copytree(folder, out / "code" / "0123456789ab")  # an older grid's snapshot, in the old place
    (copy / "runs" / "x").mkdir(parents=True)
    (copy / "runs" / "x" / "stray.py").write_text("import opsd_loss as opsd_loss\n")  # names nothing: not checked
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                          "tests/test_house.py", "tests/test_imports.py"], capture_output=True, text=True, cwd=copy,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


def test_an_installed_package_is_no_repository_to_copy(tmp_path):
    """Installed from the wheel, REPO is site-packages: not walked, hashed or copied (torch and every
    other package live there); its cells run the installed files, as before."""
    site = tmp_path / "site"
    (site / "opsd").mkdir(parents=True)
    (site / "opsd" / "__init__.py").write_text("")
    (site / "opsd_train.py").write_text("")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("")
    assert grid_cell.repository_files(site) == [] and grid_cell.code_version(site) is None
    assert grid_cell.snapshot_code(tmp_path, site) == (None, site) and not (tmp_path / ".code").exists()


def test_a_module_not_yet_added_to_git_is_in_the_snapshot_and_the_version(tmp_path):
    """A new module in a checkout whose index does not list it (written, not `git add`-ed; or a copy whose
    .git is older than its files) runs in the cells: the snapshot copies it, and the version changes with
    its bytes. Before, the snapshot listed the index only and every cell failed importing it (2026-12-06)."""
    repo = tmp_path / "repo"
    (repo / "opsd").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (repo / "opsd" / "__init__.py").write_text("")
    (repo / ".gitignore").write_text("outputs/\n")
    commit = _git_repository(repo)[:12]
    assert grid_cell.code_version(repo) == commit
    (repo / "opsd" / "new_module.py").write_text("VALUE = 1\n")
    (repo / "outputs").mkdir()
    (repo / "outputs" / "ignored.py").write_text("")  # ignored: neither copied nor versioned
    first = grid_cell.code_version(repo)
    assert first.startswith(f"{commit}+dirty-")
    (repo / "opsd" / "new_module.py").write_text("VALUE = 2\n")
    assert grid_cell.code_version(repo) not in (first, commit)
    (tmp_path / "grid").mkdir()
    version, folder = grid_cell.snapshot_code(tmp_path / "grid", repo)
    assert (folder / "opsd" / "new_module.py").read_text() == "VALUE = 2\n"
    assert not (folder / "outputs").exists()
