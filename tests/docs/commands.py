"""The commands the project prints for its users, found in the documents themselves: the
```bash (or sh) blocks and inline code spans of every document (README.md and each *.md under
megalite/, tools/, scripts/, examples/ and tests/: markdown_documents()), and the example lines of the tools' usage docstrings (tools/**/*.py and the megalite/*/cli.py modules a
tool runs; a tool's --help shows its docstring's first paragraph, the examples are in the rest).

A command is one shell command line: backslash continuations joined, a trailing `# comment`
cut, `a && b` split into two commands, runs of blanks outside quotes made one blank (`key`).
"""

import ast
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Where documents live: README.md at the top, and any *.md file under these folders (a document
# added there is read without being listed anywhere).
DOCUMENT_FOLDERS = ("megalite", "tools", "scripts", "examples", "tests")
PROGRAMS = ("python", "python3", "bash", "torchrun", "sbatch", "srun", "pip")
_ENV = r"[A-Z_][A-Z0-9_]*=\S*\s+"
_COMMAND_START = re.compile(rf"^(\.\.\.\s|({_ENV})*({'|'.join(PROGRAMS)})(\s|$))")


@dataclass(frozen=True)
class Command:
    source: str  # "README.md:268", "tools/generate.py (docstring)"
    text: str    # as written, continuations joined, comment cut

    @property
    def key(self) -> str:
        return normalise(self.text)


def _scan(text: str):
    """(index, char, quoted) for each character, quoted meaning inside '...' or "..."."""
    quote = None
    for i, c in enumerate(text):
        if quote is None and c in "'\"":
            quote = c
            yield i, c, True
        elif c == quote:
            quote = None
            yield i, c, True
        else:
            yield i, c, quote is not None


def strip_comment(line: str) -> str:
    """`line` without a shell comment: a `#` starting a word, outside quotes."""
    for i, c, quoted in _scan(line):
        if c == "#" and not quoted and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def normalise(text: str) -> str:
    """Blank runs outside quotes made one blank, ends trimmed."""
    out, blank = [], False
    for _, c, quoted in _scan(text.strip()):
        if c.isspace() and not quoted:
            blank = True
            continue
        if blank:
            out.append(" ")
            blank = False
        out.append(c)
    return "".join(out)


def split_and(text: str) -> list[str]:
    """`a && b` as [a, b] (an `&&` inside quotes stays)."""
    parts, start = [], 0
    for i, c, quoted in _scan(text):
        if not quoted and text.startswith("&&", i) and i >= start:
            parts.append(text[start:i])
            start = i + 2
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def shell_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(first line number, logical line) of shell text: continuations joined, comments cut,
    comment-only and blank lines dropped."""
    out, pending, first = [], "", None
    for number, raw in lines:
        line = strip_comment(raw)
        if not line and not pending:
            continue
        first = number if not pending else first
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((first, pending + line))
        pending = ""
    if pending:
        out.append((first, pending))
    return out


def _commands(source: str, lines: list[tuple[int, str]]) -> list[Command]:
    found = []
    for number, line in shell_lines(lines):
        for part in split_and(line):
            found.append(Command(f"{source}:{number}", part))
    return found


def markdown_commands(path: Path) -> list[Command]:
    """The commands of `path`'s ```bash blocks, and its inline code spans that are commands
    (a program of PROGRAMS, or `...`, first)."""
    rel = path.relative_to(REPO).as_posix()
    text = path.read_text(encoding="utf-8")
    found, fence, block, prose = [], None, [], []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            if fence is None:
                fence, block = line.strip()[3:], []
            else:
                found += _commands(rel, block) if fence in ("bash", "sh", "shell") else []
                fence = None
        elif fence is None:
            prose.append((number, line))
        else:
            block.append((number, line))
    found += inline_commands(rel, prose)
    return found


def inline_commands(source: str, prose: list[tuple[int, str]]) -> list[Command]:
    """Code spans of prose lines (a span may run over a line break) that are commands."""
    joined, starts = "", []
    for number, line in prose:
        starts.append((len(joined), number))
        joined += line + "\n"
    found = []
    for m in re.finditer(r"`([^`]+)`", joined):
        span = " ".join(m.group(1).split())
        if _COMMAND_START.match(span):
            number = max(n for offset, n in starts if offset <= m.start())
            found += [Command(f"{source}:{number}", part) for part in split_and(span)]
    return found


def docstring_commands(path: Path) -> list[Command]:
    """The example lines of `path`'s module docstring (lines that start with a command)."""
    rel = path.relative_to(REPO).as_posix()
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=True) or ""
    lines = [(n, line) for n, line in enumerate(doc.splitlines(), 1)]
    examples, continued = [], False
    for n, line in lines:
        if continued or _COMMAND_START.match(line.strip()):
            examples.append((n, line.strip()))
            continued = strip_comment(line).endswith("\\")
    return [Command(f"{rel} (docstring)", c.text) for c in _commands(rel, examples)]


def tool_modules() -> list[Path]:
    """tools/**/*.py and the megalite/<package>/cli.py each of them runs."""
    tools = sorted((REPO / "tools").rglob("*.py"))
    clis = set()
    for tool in tools:
        for m in re.finditer(r"^from (megalite\.\w+\.cli) import main", tool.read_text(encoding="utf-8"), re.M):
            clis.add(REPO / (m.group(1).replace(".", "/") + ".py"))
    return tools + sorted(clis)


def markdown_documents() -> list[Path]:
    """README.md and every *.md file under DOCUMENT_FOLDERS, in path order (hidden folders, such as
    a tool's cache, left out)."""
    found = [REPO / "README.md"]
    for folder in DOCUMENT_FOLDERS:
        found += sorted(p for p in (REPO / folder).rglob("*.md")
                        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(REPO).parts))
    return found


def documented_commands() -> list[Command]:
    """Every command of the documents, in document order (a command written twice, twice)."""
    found = []
    for path in markdown_documents():
        found += markdown_commands(path)
    for path in tool_modules():
        found += docstring_commands(path)
    return found
