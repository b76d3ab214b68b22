"""What `pip install .` puts into an environment: one top-level package (`opsd`, every layer a
subpackage), the research fork's three root modules, the `opsd` command and the learned tiny
default's weights; nothing else (bench/ and checks/ are repository tools). Read from the metadata
of a wheel built from this checkout's tracked files, as pip installs it."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from test_imports import ROOT, ROOT_FILES, SUBPACKAGES


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel of a copy of the tracked files (a build in the checkout would leave build/, whose
    stale files setuptools ships again)."""
    tmp = tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (tmp / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tmp / "src" / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "--wheel-dir", str(tmp / "dist"), str(tmp / "src")],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    (path,) = (tmp / "dist").glob("opsd-*.whl")
    return path


def test_the_wheel_installs_one_package_the_root_files_and_the_command(wheel):
    with zipfile.ZipFile(wheel) as archive:
        files = archive.namelist()
        info = next(name.split("/")[0] for name in files if name.endswith(".dist-info/METADATA"))
        top_level = set(archive.read(f"{info}/top_level.txt").decode().split())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert top_level == {"opsd"} | ROOT_FILES
    assert {name.split("/")[0] for name in files} == {"opsd", info} | {f"{name}.py" for name in ROOT_FILES}
    subpackages = {name.split("/")[1] for name in files if name.startswith("opsd/") and name.count("/") > 1}
    assert subpackages == set(SUBPACKAGES)
    assert "[console_scripts]\nopsd = opsd.command:main" in entry_points
    assert "opsd/tiny_default/weights/learned.safetensors" in files  # the learned default runs from the install
    assert "opsd/rollout/kernels/attention.py" in files


def test_a_grid_from_the_installed_wheel_runs_the_installed_fork_files(wheel, tmp_path):
    """Installed without the checkout, a grid's cells start the opsd_train.py installed beside
    the package (not a path computed from the package's depth)."""
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    code = "from opsd.research import cell; print(cell.REPO)"
    found = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(site)})
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.strip() == str(site.resolve()) and (site / "opsd_train.py").is_file()
