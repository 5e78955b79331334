"""The package layout's import rules (megalite/parallel/__init__.py): arrows point down only."""

import ast
import importlib
from pathlib import Path

import pytest

import megalite

PACKAGE_ROOT = Path(megalite.__file__).parent
# The packages a training run is assembled in and the tools around it: nothing below them may
# import them.
_TOP = ("megalite.training", "megalite.convert", "megalite.dryrun", "megalite.planner", "megalite.inference",
        "megalite.pretrain_gpt")
FORBIDDEN = {
    "parallel": ("megalite.model", "megalite.optimizer", "megalite.checkpoint", "megalite.config") + _TOP,
    "optimizer": ("megalite.model", "megalite.checkpoint", "megalite.config") + _TOP,
    "model": ("megalite.optimizer", "megalite.checkpoint", "megalite.config") + _TOP,
    "config": ("megalite.checkpoint",) + _TOP,
    "checkpoint": _TOP,
    # One sub-package per checkpoint format (megalite/checkpoint/__init__.py): megalite's own
    # imports no other format; Megatron's and Hugging Face's may read DCP, never each other.
    "checkpoint/dcp": ("megalite.checkpoint.megatron", "megalite.checkpoint.hf", "megalite.checkpoint.run_load",
                       "megalite.checkpoint.detect", "megalite.checkpoint.model_match",
                       "megalite.checkpoint.megalite_reader") + _TOP,
    "checkpoint/megatron": ("megalite.checkpoint.hf", "megalite.checkpoint.run_load",
                            "megalite.checkpoint.detect", "megalite.checkpoint.model_match",
                            "megalite.checkpoint.megalite_reader") + _TOP,
    "checkpoint/hf": ("megalite.checkpoint.megatron", "megalite.checkpoint.run_load",
                      "megalite.checkpoint.detect", "megalite.checkpoint.model_match",
                      "megalite.checkpoint.megalite_reader") + _TOP,
    # megalite's own option families never need Megatron's compatibility families
    "config/megatron": ("megalite.checkpoint",) + _TOP,
    "training": ("megalite.convert", "megalite.dryrun", "megalite.planner", "megalite.inference",
                 "megalite.pretrain_gpt"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in `path`, function-level ones included; relative
    imports are resolved against the file's own package."""
    package = ".".join(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def upward_imports(folder: str) -> list[str]:
    problems = []
    for path in sorted((PACKAGE_ROOT / folder).rglob("*.py")):
        for line, module in imported_modules(path):
            if any(module == bad or module.startswith(bad + ".") for bad in FORBIDDEN[folder]):
                problems.append(f"{path.relative_to(PACKAGE_ROOT.parent)}:{line} imports {module}")
    return problems


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_module_imports_upward(folder):
    assert upward_imports(folder) == []


def test_the_checker_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    planted = PACKAGE_ROOT / "parallel" / "pipeline" / "_planted_upward_import.py"
    planted.write_text("def f():\n    from ...model import gpt\n    import megalite.training.loop\n")
    try:
        found = upward_imports("parallel")
    finally:
        planted.unlink()
    assert found == ["megalite/parallel/pipeline/_planted_upward_import.py:2 imports megalite.model",
                     "megalite/parallel/pipeline/_planted_upward_import.py:2 imports megalite.model.gpt",
                     "megalite/parallel/pipeline/_planted_upward_import.py:3 imports megalite.training.loop"]


def test_one_package_per_parallel_dimension_imports():
    for name in ("megalite.parallel.tensor", "megalite.parallel.pipeline", "megalite.parallel.data",
                 "megalite.optimizer", "megalite.checkpoint", "megalite.checkpoint.dcp",
                 "megalite.checkpoint.megatron", "megalite.checkpoint.hf", "megalite.config",
                 "megalite.config.megatron"):
        module = importlib.import_module(name)
        assert module.__doc__, f"{name} has no docstring saying what lives there"


def test_no_file_over_400_lines():
    long = [f"{p.relative_to(PACKAGE_ROOT.parent)}: {n}" for p in sorted(PACKAGE_ROOT.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400]
    assert long == []


def module_graph() -> dict[str, set[str]]:
    """megalite's modules and the megalite modules each imports (`from package import module`
    counts as the module; a module's own ancestor packages are left out, importing them is
    part of importing the module)."""
    paths = {}
    for path in PACKAGE_ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
        paths[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in paths.items():
        targets = {module for _, module in imported_modules(path) if module in paths and module != name}
        targets -= {t.rsplit(".", 1)[0] for t in targets if t.rsplit(".", 1)[0] in targets}
        graph[name] = {t for t in targets if not name.startswith(t + ".")}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle's modules (strongly connected components of more than one module)."""
    order, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in order:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], order[target])
        if low[node] == order[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return cycles


def test_no_import_cycles():
    assert import_cycles(module_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", ["checkpoint", "checkpoint/dcp", "checkpoint/megatron", "checkpoint/hf",
                                     "config", "config/megatron"])
def test_every_module_of_the_one_concern_packages_says_what_it_holds(package):
    """megalite/checkpoint/: each module's docstring says which format and which direction
    (the package docstring tabulates them, sub-packages by dotted name); megalite/config/: which
    options or which step."""
    bare = []
    for path in sorted((PACKAGE_ROOT / package).glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if not doc or len(doc.split()) < 5:
            bare.append(path.name)
    assert bare == []
    if package.startswith("checkpoint"):
        table = importlib.import_module("megalite.checkpoint").__doc__
        prefix = "" if package == "checkpoint" else package.split("/")[1] + "."
        for path in (PACKAGE_ROOT / package).glob("*.py"):
            if path.stem != "__init__":
                name = prefix + path.stem.removesuffix("_moe")
                assert name in table, f"{name} missing from megalite.checkpoint's table"


def test_the_checkpoint_and_config_packages_have_no_flat_prefixes():
    """The format prefixes became sub-packages and the arguments_ prefix is gone."""
    flat = [p.name for p in (PACKAGE_ROOT / "checkpoint").glob("*.py")
            if p.stem.startswith(("dcp_", "megatron_", "hf_"))]
    flat += [p.name for p in (PACKAGE_ROOT / "config").rglob("*.py") if p.stem.startswith("arguments_")]
    assert flat == []
