"""The package move is finished: no module lives on under an old name. No import aliases a
project module as `opsd_*` (the flat layout's names), and every module the prose names, as a
dotted name (`opsd.loss.divergence_loss`, `python -m opsd.evaluation`) or as a path
(`bench/bench_step.py`), exists. Prose is the .md files and the comments and strings of the .py
files; the list of modules is tests/test_imports.py's."""
import ast
import io
import re
import tokenize
from pathlib import Path

from test_imports import ROOT, project_modules, tree_files

SKIPPED_FOLDERS = {"__pycache__", "build", "dist"}  # and hidden folders but .ci (.git, .cache, scratch)
FIELD = re.compile(r"\{[^{}]*\}")  # an f-string's replacement field is code, not prose
# Before the layers moved into the one installed package (opsd.rollout, ...), they were top-level
# packages: a dotted name or a path under an old name is a name of nothing now.
OLD_PACKAGES = ("rollout", "evaluation", "analysis", "research", "tiny_default")
PACKAGES = ("opsd", *OLD_PACKAGES)
# The folders whose files the prose names by path (relative to the repository root).
FOLDERS = (*PACKAGES, "bench", "checks", "tests", "docs", "slurm", "configs", "grids", ".ci")
OLD_NAME = re.compile(r"(?<![\w./-])(opsd_\w+)\.(\w+)")
DOTTED = re.compile(r"(?<![\w./-])((?:{})(?:\.\w+)+)".format("|".join(PACKAGES)))
# A path with a file's suffix: `opsd/true_kl` is a metric's name, `bench/common.SHAPES` a constant.
SUFFIXES = ("py", "sh", "md", "txt", "env", "json", "jsonl", "yaml", "toml", "sbatch", "safetensors")
_FOLDER, _SUFFIX = "|".join(re.escape(f) for f in FOLDERS), "|".join(SUFFIXES)
PATH = re.compile(rf"(?<![\w./-])((?:{_FOLDER})/[\w./-]*\.(?:{_SUFFIX}))(?![\w*{{<])")


def files(suffix: str) -> list[Path]:
    """The repository's own files of that suffix (tests/test_imports.py's tree_files: not a run's outputs)."""
    return sorted(path for path in tree_files() if path.name.endswith(suffix)
                  if path != Path(__file__).resolve() and not any(
                      part in SKIPPED_FOLDERS or part.endswith(".egg-info") or (part.startswith(".") and part != ".ci")
                      for part in path.relative_to(ROOT).parts))


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of what a reader reads: a .md file whole, a .py file's comments and strings."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".md":
        return list(enumerate(text.splitlines(), start=1))
    return [(token.start[0], FIELD.sub("", token.string) if "f" in token.string.split(token.string[-1])[0].lower()
             else token.string)
            for token in tokenize.generate_tokens(io.StringIO(text).readline)
            if token.type in (tokenize.COMMENT, tokenize.STRING)]


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def unresolved(dotted: str, modules: dict[str, Path], names: dict[str, set[str]]) -> str | None:
    """What of `dotted` names nothing: the longest prefix that is a module, then one attribute of it."""
    parts = dotted.split(".")
    module, rest = parts[0], parts[1:]
    if module not in modules:  # an old top-level package's name
        return dotted
    while rest and f"{module}.{rest[0]}" in modules:
        module, rest = f"{module}.{rest[0]}", rest[1:]
    if not rest or rest[0] in ("py", "md", "sh"):  # `opsd.config` or a file name's suffix
        return None
    if module not in names:
        names[module] = top_level_names(modules[module])
    return None if rest[0] in names[module] else f"{module}.{rest[0]}"


def test_no_module_is_imported_under_an_old_opsd_name():
    aliased = []
    for path in files(".py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                aliased += [f"{path.relative_to(ROOT)}:{node.lineno}: as {alias.asname}"
                            for alias in node.names if (alias.asname or "").startswith("opsd_")]
    assert not aliased, "imports under an old name (import the module under its own): " + ", ".join(aliased)


def test_the_prose_names_only_modules_and_files_that_exist():
    modules = project_modules()
    names: dict[str, set[str]] = {}
    missing = []
    for path in files(".md") + files(".py"):
        for line, text in prose(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            missing += [f"{where}: {m[1]}.{m[2]}" for m in OLD_NAME.finditer(text) if m[1] not in modules]
            missing += [f"{where}: {what}" for m in DOTTED.finditer(text)
                        if (what := unresolved(m[1], modules, names))]
            missing += [f"{where}: {m[1]}" for m in PATH.finditer(text) if not (ROOT / m[1]).exists()]
    assert not missing, "names of nothing in the repository:\n" + "\n".join(missing)


def test_the_checks_see_what_they_look_for():
    """The patterns find the old names, a missing module and a missing file; they pass real ones."""
    modules, names = project_modules(), {}
    assert [m[1] for m in OLD_NAME.finditer("as `opsd_loss.divergence_loss` and opsd_train.main")] == [
        "opsd_loss", "opsd_train"]
    assert unresolved("opsd.loss.divergence_loss", modules, names) is None
    assert unresolved("opsd.config.Recipe", modules, names) is None
    assert unresolved("opsd.logging.CollapseDetector", modules, names) == "opsd.logging"
    missing = "opsd.evaluation.evaluate.no_such_function"
    assert unresolved(missing, modules, names) == missing
    assert [m[1] for m in PATH.finditer("see bench/bench_step.py, tests/test_bench_*.py and opsd/config.py.")] == [
        "bench/bench_step.py", "opsd/config.py"]
    assert not (ROOT / "bench/no_such_bench.py").exists()
    assert unresolved("research.grid", modules, names) == "research.grid"  # moved: opsd.research.grid
    assert [m[1] for m in PATH.finditer("see research/grid.py")] == ["research/grid.py"]
    assert not (ROOT / "research/grid.py").exists()


def test_the_installed_package_is_the_house_and_nothing_patches_sys_path():
    """pyproject.toml installs one package, `opsd` (every layer a subpackage), and the root
    files, so `pip install -e .` makes every module importable (tests/test_packaging.py checks the
    built wheel); no code outside the tests puts a folder on sys.path (the grading worker's
    removal of its own folder aside)."""
    import tomllib

    from test_imports import ROOT_FILES, packages

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {p.relative_to(ROOT).parts[0] for p in packages()} == {"opsd"}
    assert setup["packages"]["find"]["include"] == ["opsd", "opsd.*"] and set(setup["py-modules"]) == ROOT_FILES
    patches = [f"{path.relative_to(ROOT)}:{n}" for path in files(".py") if "tests" not in path.relative_to(ROOT).parts
               for n, line in enumerate(path.read_text().splitlines(), 1)
               if re.search(r"sys\.path\.(insert|append)|PYTHONPATH", line) and not line.lstrip().startswith("#")]
    assert patches == []


def test_drift_once_removed_stays_gone():
    """Issue 53's drift: outside tests/, nothing defines `make_backend` or `make_objective` (tests
    alone called them; the trainer and evaluation build their own backends, the trainer its
    objective); neither the trainer nor the collator takes a `pad_side` (the probe's other
    geometries are opsd/research/probe.py's); in opsd/, only train_config imports TRL (opsd/__init__.py
    says so); opsd/analysis/significance.py takes Student's t from scipy, a requirement, not by hand."""
    defined = [f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}"
               for path in files(".py") if "tests" not in path.relative_to(ROOT).parts
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
               if isinstance(node, ast.FunctionDef) and node.name in ("make_backend", "make_objective")]
    assert defined == []
    hooks = [f"{name}:{node.lineno}: {node.name}" for name in ("opsd_trainer.py", "data_collator.py")
             for node in ast.walk(ast.parse((ROOT / name).read_text(encoding="utf-8")))
             if isinstance(node, ast.FunctionDef)
             and "pad_side" in [a.arg for a in node.args.args + node.args.kwonlyargs]]
    assert hooks == []
    trl = sorted(path.name for path in (ROOT / "opsd").glob("*.py")
                 for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                 if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "trl" for a in node.names)
                 or isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "trl")
    assert trl == ["train_config.py"]
    assert "Only `train_config` imports TRL" in (ROOT / "opsd/__init__.py").read_text(encoding="utf-8")
    stats = (ROOT / "opsd/analysis/significance.py").read_text(encoding="utf-8")
    assert "from scipy.stats import t\n" in stats and "betainc" not in stats
