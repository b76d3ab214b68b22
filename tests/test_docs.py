"""The specification lives in the repository: every reference to it names
docs/SPEC.md and a section that exists there."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "SPEC.md"


def project_files():
    """Every text file of the project but this test (whose patterns would match themselves)."""
    for pattern in ("*.py", "*.sh", "*.md", "*.env", "*.txt", "tests/*.py", "bench/*", "docs/*", ".ci/*"):
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
        assert "shared folder" not in text, path
        assert "/work/" not in text, path
