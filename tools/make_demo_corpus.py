"""Write a JSONL demo corpus from text every Python installation carries: no download.

    python tools/make_demo_corpus.py --output demo.jsonl [--max-mb 4]

Each line is {"text": ...}. Documents are the docstrings (module, class and function
docstrings of each standard-library module, one document per module) and the module
sources themselves, taken from the running interpreter's standard library in sorted path
order, so the output is the same on every run with the same Python. Writing stops once the
output reaches --max-mb megabytes. The file is written under a temporary name and renamed.
"""

import argparse
import ast
import json
import os
import sys
import sysconfig
import warnings

# Large, machine-generated or test-only parts of the standard library make a poor corpus.
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                "encodings", "lib2to3", "pydoc_data", "config-3", "ensurepip", "turtledemo"}
MAX_SOURCE_CHARS = 4_000  # long modules are cut into pieces of about this size


def stdlib_sources(stdlib_dir: str):
    """Yield (relative path, text) of the standard library's .py files in sorted order."""
    for root, dirs, files in os.walk(stdlib_dir):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("config-"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            yield os.path.relpath(path, stdlib_dir), text


def docstrings_document(text: str) -> str:
    """All docstrings of one module, joined by blank lines ('' if it does not parse)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                parts.append(doc.strip())
    return "\n\n".join(parts)


def source_pieces(text: str, max_chars: int = MAX_SOURCE_CHARS):
    """Cut a source file at line boundaries into pieces of at most about max_chars."""
    piece, size = [], 0
    for line in text.splitlines(keepends=True):
        if size + len(line) > max_chars and piece:
            yield "".join(piece)
            piece, size = [], 0
        piece.append(line)
        size += len(line)
    if piece:
        yield "".join(piece)


def demo_documents(stdlib_dir: str):
    """Yield the demo corpus documents in their fixed order."""
    for _, text in stdlib_sources(stdlib_dir):
        doc = docstrings_document(text)
        if doc:
            yield doc
        for piece in source_pieces(text):
            if piece.strip():
                yield piece


def write_demo_corpus(output: str, max_bytes: int, stdlib_dir: str | None = None) -> tuple[int, int, bool]:
    """Write the corpus to `output`; return (documents, bytes written, whether the library ran out first)."""
    stdlib_dir = stdlib_dir or sysconfig.get_paths()["stdlib"]
    tmp = f"{output}.tmp-{os.getpid()}"
    docs = written = 0
    ran_out = True
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for doc in demo_documents(stdlib_dir):
                line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
                size = len(line.encode("utf-8"))
                if written + size > max_bytes and docs:
                    ran_out = False
                    break
                f.write(line)
                docs += 1
                written += size
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return docs, written, ran_out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--max-mb", type=float, default=4.0,
                        help="stop once the output would exceed this many megabytes (default 4)")
    args = parser.parse_args(argv)
    if args.max_mb <= 0:
        parser.error(f"--max-mb must be positive, got {args.max_mb}")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        parser.error(f"--output {args.output}: directory {out_dir} does not exist")
    max_bytes = int(args.max_mb * 1e6)
    docs, written, ran_out = write_demo_corpus(args.output, max_bytes)
    print(f"wrote {docs} documents, {written / 1e6:.2f} MB to {args.output}", file=sys.stderr)
    if ran_out:
        print(f"make_demo_corpus: this Python's standard library gives only {written / 1e6:.2f} MB, "
              f"less than --max-mb {args.max_mb:g}", file=sys.stderr)


if __name__ == "__main__":
    main()
