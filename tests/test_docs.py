"""The specification lives in the repository: every reference to it names
docs/SPEC.md and a section that exists there."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "SPEC.md"


def project_files():
    """Every text file of the project but this test (whose patterns would match themselves): the
    files git lists (tracked, or new and not ignored), so that what a run or a user leaves in the
    checkout (outputs/, a .venv, the cache) is never read. At the root: .py, .sh, .md, .env and
    .txt files; below it: .py files, and every file directly in bench/, docs/ and .ci/."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode()
    for name in sorted(set(listed.split("\0")) - {""}):
        path = Path(name)
        top = len(path.parts) == 1 and path.suffix in (".py", ".sh", ".md", ".env", ".txt")
        below = len(path.parts) > 1 and (path.suffix == ".py" or (len(path.parts) == 2 and path.parts[0] in
                                                                  ("bench", "docs", ".ci")))
        if (top or below) and (ROOT / path).is_file() and ROOT / path != Path(__file__).resolve():
            yield ROOT / path


def test_project_files_are_the_listed_ones_never_what_a_run_or_a_venv_leaves():
    """A .venv (README's first command) and a grid's outputs/ in the checkout are not read."""
    names = {path.relative_to(ROOT).as_posix() for path in project_files()}
    assert {"README.md", "opsd/config.py", "docs/SPEC.md", ".ci/run", "tests/conftest.py"} <= names
    assert not any(name.startswith((".venv/", "outputs/", ".cache/")) for name in names)
    ignored = subprocess.run(["git", "check-ignore", "--no-index", ".venv/x.py", "outputs/q/code/v/opsd/x.py"],
                             cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert ignored == [".venv/x.py", "outputs/q/code/v/opsd/x.py"]


def spec_sections() -> set[str]:
    return set(re.findall(r"^## (\d+)\. ", SPEC.read_text(), flags=re.M))


def test_every_spec_reference_names_an_existing_section_of_docs_spec():
    sections = spec_sections()
    assert sections == {str(n) for n in range(1, 10)}
    cited = 0
    for path in project_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            where = f"{path.relative_to(ROOT)}:{number}"
            for match in re.finditer(r"\bSPEC\b", line):  # SPEC.md, not SPECIAL_EXIT
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


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores
    kept), each space a hyphen."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _headings(path: Path) -> list[tuple[int, str]]:
    """(line number, heading text) of a Markdown file's headings, code blocks skipped."""
    headings, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6} (.+)", line)):
            headings.append((number, match.group(1).strip()))
    return headings


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, heading in _headings(path):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_readme_reference_to_a_section_names_one_that_is_there():
    """`"X" below` / `"X" above` in README.md name a heading that starts with X on that side,
    and `README "X"` anywhere in the project names one of README's headings."""
    readme = ROOT / "README.md"
    headings = _headings(readme)
    checked = 0
    for number, line in enumerate(readme.read_text(encoding="utf-8").splitlines(), start=1):
        for name, side in re.findall(r'"([^"\n]+)" (below|above)', line):
            checked += 1
            where = [n for n, text in headings if text.startswith(name)]
            assert where, f"README.md:{number}: no section \"{name}\""
            assert any(n > number if side == "below" else n < number for n in where), \
                f"README.md:{number}: section \"{name}\" is not {side}"
    names = [text for _, text in headings]
    for path in project_files():
        for name in re.findall(r'README(?:\.md)?\'?s? "([^"\n]+)"', path.read_text(encoding="utf-8")):
            checked += 1
            assert any(text.startswith(name) for text in names), f"{path.relative_to(ROOT)}: README has no \"{name}\""
    assert checked >= 3


def test_every_anchor_link_of_the_readme_and_docs_names_a_heading_of_its_file():
    checked = 0
    for source in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = source.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
            path = (source.parent / target).resolve() if target else source
            assert path.is_file(), f"{source.relative_to(ROOT)}: link to a missing file {target}"
            if path.suffix != ".md":
                continue
            checked += 1
            where = f"{source.relative_to(ROOT)}: {target or source.name}#{anchor}"
            assert anchor in _anchors(path), f"{where} is no heading"
    assert checked >= 10


README_MAX_LINES = 300


def test_the_readme_stays_a_guide():
    """README.md is a guide of at most 300 lines: what, set-up, a real run, the grid commands,
    layout, "to change X", the switches, the headline results. Reference tables and detail go to
    docs/ and the README links them."""
    count = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert count <= README_MAX_LINES, \
        f"README.md has {count} lines, more than {README_MAX_LINES}: move reference detail to docs/ and link it"
