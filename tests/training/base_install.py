"""An environment that holds only megalite's base install (`pip install -e .`, no extras) as far
as Python can tell: a sitecustomize.py on PYTHONPATH (so every interpreter runs it, torchrun's
children too) takes the environment's site-packages off sys.path and puts in its place a folder
of links to the files of the distributions in the requirement closure of setup.py's
install_requires, so `import tensorboard` (or wandb, transformers...) fails and
importlib.util.find_spec finds nothing, as on a base install. The honest check, a fresh venv
with `pip install torch==2.13.0 -e .`, is the slow twin (test_launch_base_install.py)."""

import ast
import importlib.metadata as metadata
import re
from pathlib import Path

from packaging.requirements import Requirement

from tests.training.launch import REPO

# what any venv holds besides its requirements
ALWAYS = {"pip", "setuptools", "wheel"}


def _name(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def install_requires(setup_py: Path = REPO / "setup.py") -> list[str]:
    """setup()'s install_requires, read from setup.py's source."""
    for node in ast.walk(ast.parse(setup_py.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [ast.literal_eval(item) for item in node.value.elts]
    raise AssertionError(f"{setup_py}: no install_requires")


def base_distributions() -> set[str]:
    """install_requires and, recursively, what each installed one requires (no extras)."""
    todo = [Requirement(text).name for text in install_requires()]
    seen = set(map(_name, ALWAYS))
    while todo:
        name = _name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requirements:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def base_site_packages(folder: Path) -> Path:
    """`folder` filled with links to the top-level files and folders (packages, their libs and
    dist-info) of the base install's distributions."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in base_distributions():
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for top in {Path(f).parts[0] for f in distribution.files or [] if not str(f).startswith("..")}:
            source = Path(distribution.locate_file(top))
            if source.exists() and not (folder / top).exists():
                (folder / top).symlink_to(source)
    return folder


SITECUSTOMIZE = """import site
import sys

hidden = set(site.getsitepackages() + [site.getusersitepackages()])
sys.path[:] = [p for p in sys.path if p not in hidden] + [{view!r}]
"""


def base_install_path(folder: Path) -> Path:
    """A folder to put first on PYTHONPATH: its sitecustomize.py leaves only the base install."""
    view = base_site_packages(folder / "site-packages")
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(view=str(view)))
    return folder
