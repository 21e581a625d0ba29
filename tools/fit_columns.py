"""Fit the code of chapter sources (notebooks/*.py, jupytext py:percent) to the book's column.

    python tools/fit_columns.py notebooks/*.py

The book's content column holds 88 characters of code. A code line wider than that is reformatted,
and nothing else is touched:

- a trailing comment on a long line first loses its padding; if the line is still too long, the
  comment moves above the statement (a `# noqa` stays where it is, shortened);
- black (line length 88, strings split, quotes kept) then reformats only the statements that
  still hold a long line (`--line-ranges`);
- a block of standalone comments holding a line wider than the column is reflowed.

Markdown cells (comments in the text twin) render as prose and are left alone. A parameters cell
is never reformatted: `book.parameters_cell` reads one parameter per line, its comment on that
line, so a long one is reported for a shorter comment by hand. What is still too wide is printed,
and the exit status is 1 then. `tests/test_book.py` checks the sources and the executed chapters.

black is not a requirement of the project: `pip install black` (24.1 or later, for
`--line-ranges`; its `--unstable` style splits long strings) into any environment, or name its
executable in $BLACK.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

WIDTH = 88


def kinds(lines: list[str]) -> list[str]:
    """Per line: "header", "marker", "markdown", "parameters" or "code" (the cell it sits in)."""
    kind, out = "header", []
    for line in lines:
        if line.startswith("# %%"):
            kind = "markdown" if "[markdown]" in line else "parameters" if "parameters" in line else "code"
            out.append("marker")
        else:
            out.append(kind)
    return out


def too_wide(path: Path, cells=("code", "parameters")) -> list[int]:
    lines = path.read_text().split("\n")
    return [i for i, (line, k) in enumerate(zip(lines, kinds(lines)), 1) if k in cells and len(line) > WIDTH]


def move_trailing_comments(path: Path) -> None:
    source = path.read_text()
    lines = source.split("\n")
    kind = kinds(lines)
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        row, col = tok.start
        line = lines[row - 1]
        if kind[row - 1] == "code" and line[:col].strip() and len(line) > WIDTH:
            found[row] = (col, tok.string)
    for row in sorted(found, reverse=True):
        col, comment = found[row]
        line = lines[row - 1]
        code = line[:col].rstrip()
        if len(code) + 2 + len(comment) <= WIDTH:          # the padding alone made it long
            lines[row - 1] = f"{code}  {comment}"
            continue
        if "noqa" in comment:                                # a noqa only works where it is
            lines[row - 1] = f"{code}  # {comment[comment.index('noqa'):].split(' (')[0]}"
            continue
        indent = re.match(r"\s*", line).group(0)
        wrapped = textwrap.wrap(comment.lstrip("#").strip(), WIDTH - len(indent) - 2) or [""]
        lines[row - 1:row] = [f"{indent}# {w}" for w in wrapped] + [code]
    path.write_text("\n".join(lines))


def wrap_comments(path: Path) -> None:
    """Reflow each block of standalone comment lines (same indent, one after another) that holds a
    line wider than the column, as one paragraph."""
    lines = path.read_text().split("\n")
    kind = kinds(lines)
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if kind[i] != "code" or not stripped.startswith("#"):
            out.append(line)
            i += 1
            continue
        indent = line[:len(line) - len(stripped)]
        j = i
        while (j < len(lines) and kind[j] == "code" and lines[j].startswith(indent + "#")
               and not lines[j].startswith(indent + "# %%")):
            j += 1
        block = lines[i:j]
        if any(len(b) > WIDTH for b in block):
            text = " ".join(b.strip().lstrip("#").strip() for b in block)
            out += [f"{indent}# {w}" for w in textwrap.wrap(text, WIDTH - len(indent) - 2)]
        else:
            out += block
        i = j
    path.write_text("\n".join(out))


def black() -> list[str]:
    exe = os.environ.get("BLACK") or shutil.which("black")
    if not exe:
        sys.exit("fit_columns: black not found (pip install black, or set BLACK to its executable)")
    return [exe]


def fit(path: Path) -> list[int]:
    move_trailing_comments(path)
    rows = too_wide(path, ("code",))
    if rows:
        args = black() + ["-q", "--skip-string-normalization", "--unstable", "-l", str(WIDTH)]
        for r in rows:
            args += ["--line-ranges", f"{r}-{r}"]
        subprocess.run(args + [str(path)], check=True)
    wrap_comments(path)
    return too_wide(path)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    left = 0
    for name in argv:
        path = Path(name)
        rows = fit(path)
        lines = path.read_text().split("\n")
        for row in rows:
            print(f"{path}:{row}: {len(lines[row - 1])} columns, still too wide")
            left += 1
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
