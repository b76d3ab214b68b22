"""The specification lives in the repository: every reference to it names
docs/SPEC.md and a section that exists there."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "SPEC.md"


def project_files():
    """Every text file of the project but this test (whose patterns would match themselves)."""
    for pattern in ("*.py", "*.sh", "*.md", "*.env", "*.txt", "tests/**/*.py", "*/**/*.py", "bench/*", "docs/*",
                    ".ci/*"):
        yield from (path for path in ROOT.glob(pattern) if path.is_file() and path != Path(__file__).resolve())


def spec_sections() -> set[str]:
    return set(re.findall(r"^## (\d+)\. ", SPEC.read_text(), flags=re.M))


def test_every_spec_reference_names_an_existing_section_of_docs_spec():
    sections = spec_sections()
    assert sections == {str(n) for n in range(1, 9)}
    cited = 0
    for path in project_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            where = f"{path.relative_to(ROOT)}:{number}"
            for match in re.finditer(r"SPEC", line):
                before = line[max(match.start() - 5, 0):match.start()]
                assert before == "docs/" or path == SPEC, f"{where}: a spec reference that is not docs/SPEC.md"
            for first, last in re.findall(r"docs/SPEC\.md`? §(\d+)(?:-§(\d+))?", line):
                cited += 1
                assert {first, last or first} <= sections, f"{where}: docs/SPEC.md has no section {first}"
    assert cited >= 10


def test_nothing_points_outside_the_repository():
    for path in project_files():
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"(?<![\w/}])\.\./\w", text), path  # no path above the repository
        assert "/work/" not in text, path


def test_reference_commands_are_valid_commands_of_this_repository():
    """Each arm of the reference table in OPSD_EXPERIMENTS.md is a train_capped.sh
    command whose switches and recipe file this repository accepts."""
    from opsd.config import Switches, parse_recipe

    text = (ROOT / "OPSD_EXPERIMENTS.md").read_text()
    table = text.split("## Reference results reported by the fork's study (not run here)", 1)[1].split("\n\n")[2]
    commands = re.findall(r"\| `((?:OPSD_\w+=\S+ )+bash train_capped\.sh(?: \S+)?)` \|$", table, flags=re.M)
    assert len(commands) == 5
    outputs = set()
    for command in commands:
        assignments, script = command.split("bash train_capped.sh")
        recipe = script.split()
        env = dict(a.split("=", 1) for a in assignments.split())
        Switches.from_env(env)  # raises on a bad switch value
        outputs.add(env["OPSD_OUTPUT"])
        parse_recipe(ROOT / (recipe[0] if recipe else "recipe.env"))
    assert len(outputs) == 5  # one run folder per arm: a shared one would resume another arm
