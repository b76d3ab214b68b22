"""The pins of requirements.txt and requirements-gpu.txt agree with each other.

vLLM pins torch exactly and bounds transformers, so an unpinned (or wrongly pinned)
vLLM makes `pip install -r requirements-gpu.txt` silently replace the torch and
transformers that requirements.txt pins. These tests read both files and check the
vLLM pin against what each vLLM release requires and against the vLLM range TRL
supports.
"""
import importlib.metadata
import inspect
import re
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
    "0.26.0": {"torch": "==2.11.0", "transformers": ">=5.5.3"},  # the release run on the H200 (README "Versions")
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


@pytest.fixture(scope="module")
def pinned():
    core, gpu = pins("requirements.txt"), pins("requirements-gpu.txt")
    return {
        "torch": exact_version(core["torch"]),
        "transformers": exact_version(core["transformers"]),
        "trl": exact_version(core["trl"]),
        "vllm": exact_version(gpu["vllm"]),
    }


def test_vllm_pin_keeps_the_pinned_torch_and_transformers(pinned):
    assert pinned["vllm"] in VLLM_REQUIRES, "record the new vLLM's requirements in VLLM_REQUIRES"
    assert compatible(pinned["vllm"], pinned["torch"], pinned["transformers"]), VLLM_REQUIRES[pinned["vllm"]]


def test_vllm_pin_is_in_trls_supported_range(pinned):
    assert pinned["trl"] == TRL_VLLM_RANGE["trl"], "re-read TRL's supported vLLM range for the new TRL pin"
    assert in_trl_range(pinned["vllm"])


def test_vllm_pin_is_the_newest_that_fits(pinned):
    """Of the recorded releases, the pin is the newest that keeps both pins and TRL's range
    (0.31 caps transformers below the pinned one; 0.33, the newest, also moves torch)."""
    fitting = [v for v in VLLM_REQUIRES
               if compatible(v, pinned["torch"], pinned["transformers"]) and in_trl_range(v)]
    assert pinned["vllm"] == max(fitting, key=Version)
    assert not compatible("0.33.0", pinned["torch"], pinned["transformers"])


def test_trl_range_is_the_installed_trls(pinned):
    if importlib.metadata.version("trl") != TRL_VLLM_RANGE["trl"]:
        pytest.skip("the installed TRL is not the one TRL_VLLM_RANGE was read from")
    from trl import import_utils

    source = inspect.getsource(import_utils.is_vllm_available)
    bounds = re.search(r'Version\("([\d.]+)"\)\s*<=\s*\w+\s*<=\s*Version\("([\d.]+)"\)', source)
    assert bounds and bounds.groups() == (TRL_VLLM_RANGE["lowest"], TRL_VLLM_RANGE["highest"])


def test_installed_vllm_matches_the_pin(pinned):
    """On a GPU machine set up from the README, the installed vLLM is the pinned one and
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
    the range the project accepts (rollout.VLLM_SUPPORTED), which is TRL's."""
    import rollout

    assert set(rollout.VLLM_RUN) <= set(VLLM_REQUIRES)
    assert all(in_trl_range(v) for v in rollout.VLLM_RUN)
    assert rollout.VLLM_SUPPORTED == (TRL_VLLM_RANGE["lowest"], TRL_VLLM_RANGE["highest"])
    assert compatible("0.26.0", "2.11.0", "5.17.0")
