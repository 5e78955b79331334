"""Every command the project prints for its users runs (issue 22, item 3): the commands of
README.md, every *.md document under megalite/, tools/, scripts/, examples/ and tests/, and the
tools' usage docstrings are found in the documents (tests/docs/commands.py), each has an entry
in tests/docs/readme_table.py or tool_table.py, and each entry runs at toy scale, through bash,
in a workspace that looks like a checkout (tests/docs/workspace.py), or names the tests that run
it, or says why it cannot run here. A command added to a document, or changed there, without an
entry fails the first test. The commands the tools themselves print (convert.py's "To train from
it", plan.py's finalists) run too, from the tools' own output.

`python -m tests.docs.test_readme_commands` prints which entries run in the default suite, which
are slow, which are covered elsewhere and which cannot run here.
"""

import re
from pathlib import Path

import pytest

from tests.docs import readme_table, tool_table
from tests.docs.commands import REPO, documented_commands, normalise, shell_lines
from tests.docs.workspace import (
    BUILDERS, CannotRun, Checked, Elsewhere, Prose, Run, SameAs, make_workspace, toy_command,
)

TABLES = {"readme_table.README": readme_table.README, "readme_table.EXAMPLES": readme_table.EXAMPLES,
          "tool_table.TOOLS": tool_table.TOOLS, "tool_table.BENCHMARKS": tool_table.BENCHMARKS}
TABLE = {command: entry for table in TABLES.values() for command, entry in table.items()}
RUNS = {entry.name: (command, entry) for command, entry in TABLE.items() if isinstance(entry, Run)}
# What a printed launch line leaves to the user ("add your data, tokenizer and learning-rate
# flags"; the convert hint: "plus your data, batch and lr flags"), at toy size.
PLAN_RUN = "--mock-data --lr 1e-3 --train-iters 2 --eval-iters 0 --log-interval 1"
HINT_RUN = ("--data-path data/corpus_text_document --micro-batch-size 1 --global-batch-size 2 --lr 1e-4 "
            "--train-iters 2 --eval-iters 0 --log-interval 1")


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("readme-commands"), RUNS)


def test_every_documented_command_has_an_entry():
    documented = documented_commands()
    missing = sorted({f"{c.source}: {c.key}" for c in documented if c.key not in TABLE})
    assert not missing, ("commands without an entry in tests/docs/readme_table.py or tool_table.py (give each a "
                         "toy-scale Run, or the tests that run it, or why it cannot run here):\n" + "\n".join(missing))
    stale = sorted(set(TABLE) - {c.key for c in documented})
    assert not stale, "entries for commands no document prints any more:\n" + "\n".join(stale)


def test_the_listing_the_readme_points_to_runs():
    """`python -m tests.docs.test_readme_commands`, as README.md's contributing section gives it."""
    import subprocess
    import sys

    from tests.docs.commands import REPO

    done = subprocess.run([sys.executable, "-m", "tests.docs.test_readme_commands"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "runs in the default suite" in done.stdout and "cannot run here" in done.stdout


def test_each_command_has_one_entry_and_each_run_its_own_name():
    keys = [k for table in TABLES.values() for k in table]
    assert sorted(k for k in set(keys) if keys.count(k) > 1) == []
    assert all(normalise(k) == k for k in keys), "write each key as the command normalised (one blank between words)"
    names = [e.name for e in TABLE.values() if isinstance(e, Run)]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
    for name, (_, run) in RUNS.items():
        unknown = [n for n in run.needs if n not in RUNS and n not in BUILDERS]
        assert not unknown, f"{name} needs {unknown}: neither an input nor an entry"


def _test_exists(reference: str) -> bool:
    if reference.startswith("run:"):
        return reference[4:] in RUNS
    path, _, name = reference.partition("::")
    file = REPO / path
    return file.is_file() and (not name or re.search(rf"^def {re.escape(name)}\(", file.read_text(), re.M) is not None)


def test_the_tests_named_as_covering_a_command_exist():
    for command, entry in TABLE.items():
        if isinstance(entry, (Elsewhere, CannotRun)):
            assert entry.why, command
            missing = [t for t in entry.tests if not _test_exists(t)]
            assert not missing, f"{command}: {missing} not found"
        if isinstance(entry, Elsewhere):
            assert entry.tests, command
    assert "<!-- test-command -->" in (REPO / "README.md").read_text()
    assert "test-command" in (REPO / ".ci/run").read_text()


def test_a_same_as_entry_becomes_its_run_word_for_word():
    for command, entry in TABLE.items():
        if isinstance(entry, SameAs):
            assert normalise(toy_command(command, entry)) == RUNS[entry.run][0], command


def test_what_an_install_command_names_exists():
    for command, entry in TABLE.items():
        if isinstance(entry, Checked):
            entry.check(command)


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if run.slow else [])
                                  for name, (_, run) in RUNS.items()])
def test_documented_command(workspace, name):
    reason = RUNS[name][1].requires and RUNS[name][1].requires()
    if reason:
        pytest.skip(reason)
    workspace.ensure(name)


def _metrics_logged(ws, metrics: Path, iterations: int):
    from tests.docs.checks import logged

    logged(str(metrics.relative_to(ws.root)), range(1, iterations + 1))(ws, None)


@pytest.mark.slow
def test_convert_hint_runs(workspace):
    """The command convert.py prints after converting to megalite trains from the checkpoint."""
    workspace.ensure("readme-preprocess")
    out = workspace.ensure("readme-convert-to-megalite").stdout.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("  torchrun "))
    end = next(i for i in range(start, len(out)) if not out[i].split("#")[0].rstrip().endswith("\\"))
    [(_, hint)] = shell_lines(list(enumerate(out[start:end + 1])))
    metrics = workspace.path("checkpoints/hint/metrics.jsonl")
    proc = workspace.shell(f"{hint} {HINT_RUN} --metrics-file {metrics}", timeout=600)
    assert proc.returncode == 0, f"$ {hint}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    _metrics_logged(workspace, metrics, 2)


def _finalists(stdout: str) -> list[str]:
    return re.findall(r"^   (NPROC_PER_NODE=\S+ (?:NNODES=\S+ )?bash scripts/pretrain_gpt\.sh .*)$", stdout, re.M)


@pytest.mark.slow
@pytest.mark.parametrize("plan, rank", [("readme-plan-a100", 0), ("readme-plan-a100", 1), ("readme-plan-a100", 2),
                                        ("readme-plan-cpu", 0)])
def test_plan_finalists_run(workspace, plan, rank):
    """Each launch line plan.py prints runs as printed, with the flags it leaves to the user."""
    line = _finalists(workspace.ensure(plan).stdout)[rank]
    metrics = workspace.path(f"checkpoints/{plan}-{rank}/metrics.jsonl")
    proc = workspace.shell(f"{line} {PLAN_RUN} --metrics-file {metrics}", timeout=600)
    assert proc.returncode == 0, f"$ {line}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    _metrics_logged(workspace, metrics, 2)


def accounting() -> str:
    """Which entries run in the default suite, which are slow, which are covered elsewhere and
    which cannot run here."""
    groups = {"runs in the default suite": [], "runs in the slow suite": [], "same as another entry's run": [],
              "covered elsewhere": [], "cannot run here": [], "checked, not run": [], "prose, not a command": []}
    for command, entry in TABLE.items():
        if isinstance(entry, Run):
            groups["runs in the slow suite" if entry.slow else "runs in the default suite"].append(
                f"{entry.name}: {command}")
        elif isinstance(entry, SameAs):
            groups["same as another entry's run"].append(f"{command} -> {entry.run}")
        elif isinstance(entry, Elsewhere):
            groups["covered elsewhere"].append(f"{command} -> {', '.join(entry.tests)}")
        elif isinstance(entry, CannotRun):
            groups["cannot run here"].append(f"{command}: {entry.why}")
        elif isinstance(entry, Checked):
            groups["checked, not run"].append(f"{command}: {entry.why}")
        elif isinstance(entry, Prose):
            groups["prose, not a command"].append(f"{command}: {entry.why}")
    return "\n".join(f"## {title} ({len(lines)})\n" + "\n".join(f"- {line}" for line in lines)
                     for title, lines in groups.items())


if __name__ == "__main__":
    print(accounting())
