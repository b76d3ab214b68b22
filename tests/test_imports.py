"""The project's own modules import each other without cycles (lazy imports inside
functions included): shared helpers live in leaf modules (opsd.model_utils, opsd.sampling,
opsd.answers, opsd.jsonl), not in one of the modules that use them."""
import ast
import functools
from pathlib import Path

from opsd.research.cell import repository_files

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def tree_files() -> tuple[Path, ...]:
    """The repository's files: tracked and untracked-not-ignored ones in a git checkout, the files its
    .gitignore does not name in a copy (opsd.research.cell.repository_files). Never what a run
    wrote: a grid's code snapshot under outputs/ holds a copy of opsd/."""
    return tuple(ROOT / name for name in repository_files(ROOT, untracked=True))


def python_files(folder: Path) -> list[Path]:
    """The .py files directly in `folder` (the checkout's own)."""
    return [path for path in tree_files() if path.parent == folder and path.suffix == ".py"]


def packages() -> list[Path]:
    """Every package folder of the project (a folder with __init__.py; sub-packages too)."""
    return sorted(init.parent for init in tree_files()
                  if init.name == "__init__.py" and not {"tests", "bench"} & set(init.relative_to(ROOT).parts))


def project_modules() -> dict[str, Path]:
    modules = {path.stem: path for path in python_files(ROOT)}
    for folder in packages():
        package = ".".join(folder.relative_to(ROOT).parts)
        for path in python_files(folder):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def imports_of(path: Path, package: str | None, known: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside the package
                base = package or ""
                names = [f"{base}.{node.module}" if node.module else base]
                names += [f"{names[0]}.{alias.name}" for alias in node.names]
            else:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def test_no_import_cycles():
    modules = project_modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        package = ".".join(path.parent.relative_to(ROOT).parts) if path.parent != ROOT else None
        graph[name] = imports_of(path, package, known) - {name}
    # A package's __init__ importing its own submodules is not a cycle.
    graph = {name: {dep for dep in deps if not (name in known and dep.startswith(f"{name}."))}
             for name, deps in graph.items()}

    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name, path):
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert {"opsd.rollout", "opsd.rollout.static_decode", "opsd.model_utils", "opsd.sampling", "opsd.jsonl"} <= known


def test_shared_helpers_live_in_leaf_modules():
    modules = project_modules()
    for leaf in ("opsd.model_utils", "opsd.sampling", "opsd.jsonl"):
        assert not imports_of(modules[leaf], None, set(modules)), f"{leaf} should import no project module"


# The layers, bottom up (README "Layout"): a module imports only from a lower layer or from
# inside its own unit. One package is installed, `opsd`: its layers are its subpackages
# (opsd.tiny_default, opsd.rollout, ...) and its own modules (opsd.loss, opsd.config, ...), the
# method's library. The root's research-fork files (the trainer, the CLI and the collator the
# trainer takes its prompts and padding from) are one layer: the research tools build and drive
# the trainer. The `opsd` command (opsd.command) is the top layer of its own: it starts the
# entry points of every layer (lazily), and nothing imports it.
COMMAND = "opsd.command"
SUBPACKAGES = ("tiny_default", "rollout", "analysis", "evaluation", "research")
LAYERS = (("opsd.tiny_default",), ("opsd",), ("opsd.rollout", "opsd.analysis"), ("opsd.evaluation",),
          ("opsd_trainer", "opsd_train", "data_collator"), ("opsd.research",), (COMMAND,))
ROOT_FILES = {"opsd_trainer", "opsd_train", "data_collator"}


def unit_of(name: str) -> str:
    """The layer member a module belongs to: opsd.<subpackage>, the command, the method's library
    (`opsd` and its own modules) or the root files."""
    parts = name.split(".")
    if name == COMMAND:
        return COMMAND
    if parts[0] in ROOT_FILES:
        return "root"
    if parts[0] == "opsd" and len(parts) > 1 and parts[1] in SUBPACKAGES:
        return f"opsd.{parts[1]}"
    return parts[0]


def layer_of(name: str) -> int:
    unit = unit_of(name)
    return next(i for i, members in enumerate(LAYERS) if (unit if unit != "root" else name.split(".")[0]) in members)


def test_only_the_research_fork_files_stay_at_the_root():
    assert {path.stem for path in python_files(ROOT)} == ROOT_FILES
    assert {".".join(p.relative_to(ROOT).parts) for p in packages()} == {
        "opsd", *(f"opsd.{name}" for name in SUBPACKAGES), "opsd.rollout.kernels"}


def test_every_import_goes_down_a_layer_or_stays_in_its_package():
    modules = project_modules()
    known = set(modules)
    upward = []
    for name, path in modules.items():
        package = ".".join(path.parent.relative_to(ROOT).parts) if path.parent != ROOT else None
        for dep in imports_of(path, package, known):
            if unit_of(dep) != unit_of(name) and layer_of(dep) >= layer_of(name):
                upward.append(f"{name} -> {dep}")
    assert not upward, "imports that do not go down a layer: " + ", ".join(sorted(upward))


def test_the_rollout_engine_and_the_method_library_import_without_trl():
    import subprocess
    import sys

    code = ("import sys, opsd.rollout, opsd.rollout.static_decode, opsd.rollout.paged_decode, "
            "opsd.rollout.merged_student, "
            "opsd.rollout.vllm_weights, opsd.rollout.trl_patches, opsd.loss, opsd.chunked_loss, opsd.objective, "
            "opsd.scoring, opsd.prompts, opsd.data, opsd.config, opsd.grading, opsd.evaluation.evaluate; "
            "print(sorted(m for m in ('trl', 'vllm') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-2000:]


def test_the_command_is_the_top_layer():
    """opsd.command reaches every entry point, and an import of it from any module would go up."""
    modules = project_modules()
    deps = imports_of(modules[COMMAND], "opsd", set(modules))
    assert {"opsd_train", "opsd.research.grid", "opsd.evaluation.evaluate", "opsd.analysis.stats",
            "opsd.config"} <= deps
    assert layer_of(COMMAND) == len(LAYERS) - 1 > layer_of("opsd.research.grid")
    assert unit_of(COMMAND) != unit_of("opsd.cli")
