"""Is this machine's install the one the project pins: requirements.txt (CPU) or
requirements-gpu.txt (the GPU stack that ran)?

    opsd doctor [--cpu | --gpu | REQUIREMENTS]
    python checks/check_gpu_stack.py [--cpu | --gpu | REQUIREMENTS]     # the same check

Which file: `--cpu` requirements.txt, `--gpu` requirements-gpu.txt, a path that file; without
one, the install decides: a GPU install (an installed vLLM, or a torch built for CUDA:
torch.version.cuda, read from torch/version.py without importing torch) is checked against
requirements-gpu.txt, any other against requirements.txt. The first line says which file and why.
Then one line per requirement: the package, what the file asks for, what is installed, ok or
MISMATCH / MISSING. An exact pin must be the installed version exactly, build label included
(a pin of 2.11.0+cu130 would refuse 2.11.0+cpu; a pin of 2.11.0 takes any build of it); a range
must contain it; an unpinned package must be installed. Exit status 0 when every line is ok,
1 otherwise, 2 for an unreadable file. Reads package metadata only: nothing is imported, so
it runs on a machine without a GPU too. `python -m pip check` checks the rest of the
environment.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

# The checkout's requirements files: the editable install (install.sh) runs this file from the
# checkout; an install without one names the file to compare with.
ROOT = Path(__file__).resolve().parents[1]
STACKS = {"cpu": "requirements.txt", "gpu": "requirements-gpu.txt"}


def read_requirements(path: Path) -> list[Requirement]:
    """The requirement lines of a requirements file, in order (comments and blanks skipped)."""
    requirements = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            requirements.append(Requirement(line))
        except InvalidRequirement as exc:
            raise ValueError(f"{path}:{number}: {line!r} is not a requirement ({exc})") from None
    return requirements


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def exact_pin(requirement: Requirement) -> str | None:
    specs = list(requirement.specifier)
    return specs[0].version if len(specs) == 1 and specs[0].operator in ("==", "===") else None


def verdict(requirement: Requirement, installed: str | None) -> str:
    """ok, MISSING, or MISMATCH with the reason."""
    if installed is None:
        return "MISSING"
    pin = exact_pin(requirement)
    try:
        version = Version(installed)
    except InvalidVersion:
        return f"MISMATCH (installed version {installed!r} is not a version)"
    if pin is not None:
        pinned = Version(pin)
        # A pinned build label must match (2.11.0 is not 2.11.0+cu130); a pin without one accepts
        # any build of the release, as pip does.
        if version == pinned or (not pinned.local and version.public == pinned.public):
            return "ok"
        if version.public == pinned.public:
            return f"MISMATCH (the same release, another build: {installed} instead of {pin})"
        return "MISMATCH"
    if not requirement.specifier or requirement.specifier.contains(version, prereleases=True):
        return "ok"
    return "MISMATCH"


def check(requirements: list[Requirement], installed: Callable[[str], str | None]) -> tuple[list[str], int]:
    """The report's lines and how many requirements the installed packages miss;
    `installed(name)` is the installed version of a package, None when it is not installed."""
    rows = [("package", "pinned", "installed", "")]
    for requirement in requirements:
        version = installed(requirement.name)
        rows.append((requirement.name, str(requirement.specifier) or "any", version or "-",
                     verdict(requirement, version)))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{n:<{widths[0]}}  {p:<{widths[1]}}  {v:<{widths[2]}}  {r}".rstrip() for n, p, v, r in rows]
    return lines, sum(row[3] != "ok" for row in rows[1:])


def torch_cuda() -> str | None:
    """torch.version.cuda of the installed torch (None: a CPU build, or no torch), read from its
    torch/version.py: importing torch takes seconds and may fail on a broken install."""
    try:
        text = Path(str(metadata.distribution("torch").locate_file("torch/version.py"))).read_text()
    except (metadata.PackageNotFoundError, OSError):
        return None
    match = re.search(r"^cuda\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", text, flags=re.M)
    return match.group(1) if match else None


def detect_stack(installed: Callable[[str], str | None], cuda: str | None) -> tuple[str, str]:
    """("gpu" or "cpu", why) for an install: vLLM or a CUDA torch make it a GPU install."""
    if installed("vllm"):
        return "gpu", f"vLLM {installed('vllm')} is installed"
    if cuda:
        return "gpu", f"torch {installed('torch')} is built for CUDA {cuda}"
    torch = installed("torch")
    return "cpu", (f"torch {torch} is a CPU build and vLLM is not installed" if torch
                   else "torch and vLLM are not installed")


def main(argv: list[str] | None = None, prog: str = "opsd doctor") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="Compare the installed packages with the project's pins: "
                                     "requirements.txt (a CPU install) or requirements-gpu.txt (a GPU install, the "
                                     "stack that ran); one line per package, exit 0 when all are as pinned.")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--cpu", dest="stack", action="store_const", const="cpu",
                       help="check against requirements.txt (what bash install.sh installs)")
    which.add_argument("--gpu", dest="stack", action="store_const", const="gpu",
                       help="check against requirements-gpu.txt (what bash install.sh --gpu installs)")
    which.add_argument("requirements", nargs="?", help="a requirements file to check against (default: "
                       "requirements-gpu.txt with an installed vLLM or a CUDA torch, else requirements.txt)")
    args = parser.parse_args(argv)
    if args.requirements:
        name, why = args.requirements, "the file given"
    elif args.stack:
        name, why = STACKS[args.stack], f"asked with --{args.stack}"
    else:
        stack, reason = detect_stack(installed_version, torch_cuda())
        name, why = STACKS[stack], f"a {stack.upper()} install: {reason}; --cpu / --gpu choose"
    path = Path(args.requirements) if args.requirements else ROOT / name
    try:
        requirements = read_requirements(path)
    except OSError as exc:
        print(f"error: {name}: cannot read it ({exc.strerror or exc})", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"checking the installed packages against {name} ({why})")
    lines, mismatches = check(requirements, installed_version)
    print("\n".join(lines))
    print(f"{name}: " + (f"{mismatches} of {len(requirements)} not as pinned" if mismatches
                        else f"all {len(requirements)} as pinned"))
    return 1 if mismatches else 0
