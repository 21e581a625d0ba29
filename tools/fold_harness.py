"""Fold the harness out of the reader's way: tag `hide-input` on every chapter cell that only sets
up, asserts, prints, glues or formats (the output stays on the page, the code one click away, and
the cell still runs under nbval).

    python tools/fold_harness.py notebooks/*.py          # report what it would fold
    python tools/fold_harness.py --apply notebooks/*.py  # add the tags

A code cell is folded when it is the imports cell, the cell that validates the parameters
(`book.validated`), or when its statements are harness (asserts; print, display, `book.glue` and
`gradtie.book.pages` calls; assignments of formatted text; loops and ifs of those) for at least three
quarters of its lines, or half of them in a cell nbval compares (`nbval-check-output`: its output
is the figure it prints). Figure cells (`plt.show()`) stay open. tests/test_book.py checks that
every cell that is harness through and through is folded.
"""

import ast
import glob
import json
import re
import sys

HARNESS_CALLS = {"print", "display"}


def callname(node):
    f = node.func
    parts = []
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if isinstance(f, ast.Name):
        parts.append(f.id)
    return ".".join(reversed(parts))


def is_stringy(v):
    if isinstance(v, (ast.JoinedStr,)) or (isinstance(v, ast.Constant) and isinstance(v.value, str)):
        return True
    if isinstance(v, ast.BinOp):
        return is_stringy(v.left) or is_stringy(v.right)
    if isinstance(v, ast.Call):
        n = callname(v)
        return (
            n == "book.glue"
            or n.endswith(".join")
            or n.endswith(".format")
            or n.endswith(".summary")
            or n.startswith("pages.")
        )
    if isinstance(v, ast.IfExp):
        return is_stringy(v.body) and is_stringy(v.orelse)
    return False


def harness(st):
    """Whether a statement only asserts, prints, glues or formats."""
    if isinstance(st, ast.Assert):
        return True
    if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
        n = callname(st.value)
        return n in HARNESS_CALLS or n == "book.glue" or n.startswith("pages.")
    if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
        return True
    if isinstance(st, (ast.Assign, ast.AnnAssign)):
        return st.value is not None and is_stringy(st.value)
    if isinstance(st, ast.For):
        return all(harness(s) for s in st.body + st.orelse)
    if isinstance(st, ast.If):
        return all(harness(s) for s in st.body + st.orelse)
    return False


def cells(text):
    lines = text.split("\n")
    out, cur, hdr = [], [], None
    for i, l in enumerate(lines):
        if l.startswith("# %%"):
            if hdr is not None:
                out.append((hdr, cur))
            hdr, cur = (i, l), []
        elif hdr is not None:
            cur.append(l)
    if hdr is not None:
        out.append((hdr, cur))
    return lines, out


def classify(path):
    """(line, header, why, lines) of every code cell of `path` the rule folds."""
    text = open(path).read()
    lines, cs = cells(text)
    res = []
    first_code = True
    for (i, hdr), body in cs:
        if "[markdown]" in hdr or "parameters" in hdr:
            continue
        src = "\n".join(body).strip()
        if not src:
            continue
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        sts = tree.body
        why = None
        if first_code and all(isinstance(s, (ast.Import, ast.ImportFrom, ast.Expr)) for s in sts):
            why = "setup"
        elif "book.validated(" in src:
            why = "setup"
        elif sts and all(harness(s) for s in sts):
            why = "harness"
        elif "plt.show()" not in src:
            hl = sum(s.end_lineno - s.lineno + 1 for s in sts if harness(s))
            al = sum(s.end_lineno - s.lineno + 1 for s in sts)
            if hl >= 0.75 * al or ("nbval-check-output" in hdr and hl >= 0.5 * al):
                why = "mostly harness"
        first_code = False
        if why:
            res.append((i, hdr, why, len(body)))
    return lines, res


def tag(path, apply=False):
    """The cells of `path` to fold that are not folded yet: (line, header, why, lines); with
    `apply`, tag them."""
    lines, res = classify(path)
    res = [r for r in res if "hide-input" not in r[1] and "remove-input" not in r[1]]
    for i, hdr, why, n in res:
        m = re.match(r"# %%(?: tags=(\[.*\]))?\s*$", hdr)
        if not m:
            print(f"{path}: a cell header it cannot read: {hdr}")
            continue
        tags = json.loads(m.group(1)) if m.group(1) else []
        if "hide-input" not in tags:
            tags.append("hide-input")
        lines[i] = "# %% tags=" + json.dumps(tags)
    if apply:
        open(path, "w").write("\n".join(lines))
    return res


def main(argv):
    apply = "--apply" in argv
    paths = [a for a in argv if not a.startswith("--")] or sorted(glob.glob("notebooks/*.py"))
    for path in paths:
        res = tag(path, apply)
        print(f"{path}: {len(res)} cells {'folded' if apply else 'to fold'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
