"""What `pip install .` puts into an environment: one top-level package (`opsd`, every layer a
subpackage), the research fork's three root modules, the `opsd` command and the learned tiny
default's weights; nothing else (bench/ and checks/ are repository tools). Read from the metadata
of a wheel built from this checkout, as pip installs it."""
import subprocess
import sys
import zipfile

from test_imports import ROOT, ROOT_FILES, SUBPACKAGES


def test_the_wheel_installs_one_package_the_root_files_and_the_command(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "--wheel-dir", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("opsd-*.whl")
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
