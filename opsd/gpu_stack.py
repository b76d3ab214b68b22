"""Is this machine's GPU stack the one requirements-gpu.txt pins (the one that ran)?

    opsd doctor [REQUIREMENTS]     # default: the checkout's requirements-gpu.txt
    python checks/check_gpu_stack.py [REQUIREMENTS]     # the same check

One line per requirement: the package, what the file asks for, what is installed, ok or
MISMATCH / MISSING. An exact pin must be the installed version exactly, build label included
(a pin of 2.11.0+cu130 would refuse 2.11.0+cpu; a pin of 2.11.0 takes any build of it); a range
must contain it; an unpinned package must be installed. Exit status 0 when every line is ok,
1 otherwise, 2 for an unreadable file. Reads package metadata only: nothing is imported, so
it runs on a machine without a GPU too. `python -m pip check` checks the rest of the
environment.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

# The checkout's requirements-gpu.txt: the editable install (install.sh) runs this file from the
# checkout; an install without one names the file to compare with.
ROOT = Path(__file__).resolve().parents[1]


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


def main(argv: list[str] | None = None, prog: str = "opsd doctor") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="Compare the installed packages with requirements-gpu.txt "
                                     "(the GPU stack that ran): one line per package, exit 0 when all are as pinned.")
    parser.add_argument("requirements", nargs="?", default=str(ROOT / "requirements-gpu.txt"),
                        help="a requirements file (default: the checkout's requirements-gpu.txt)")
    args = parser.parse_args(argv)
    try:
        requirements = read_requirements(Path(args.requirements))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lines, mismatches = check(requirements, installed_version)
    print("\n".join(lines))
    print(f"{args.requirements}: " + (f"{mismatches} of {len(requirements)} not as pinned" if mismatches
                                      else f"all {len(requirements)} as pinned"))
    return 1 if mismatches else 0

