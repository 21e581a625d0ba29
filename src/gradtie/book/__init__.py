"""The book's support code: the chapter list, chapter parameters (validation and the profiles ci,
cpu, gpu) and the book build.

`gradtie.book` imports the kit (`gradtie.ops`, `gradtie.nets`, `gradtie.checks`, …) and the kit never
imports it (tests/test_layout.py): a reader who wants only the checker never loads it. Beside this
module: `plots` (a module of figures per chapter), `pages` (a report's rows as a book page's table),
`companions` (the chapters' Lean companions), `claims` (the intro's claim map), `assertions`
(chapter asserts that explain themselves) and `workloads` (what each chapter compiles, for
`gradtie bench --abstract`).

`make book` calls `execute` (papermill runs every chapter notebook into `book/` with the profile's
parameters) and then `render` (Jupyter Book 1.x, failing on any warning).

An executed notebook carries the key of what it was computed from (`source_key`: its chapter's
source, the package, the pinned requirements, the files it reads, the parameters). `execute`
reuses a notebook whose key is the chapter's key now, and runs every other one: a chapter whose
source, or any code it can reach, changed always re-executes. The committed notebooks/ carry the
ci key, so a fresh clone's `make book` renders them without running them again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Optional

from gradtie.progress import bar

from . import workloads
from .assertions import explain_asserts

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOKS = ROOT / "notebooks"
BOOK = ROOT / "book"


@dataclass(frozen=True)
class Chapter:
    name: str                       # notebooks/<name>.ipynb -> book/<name>.ipynb
    title: str
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)  # profile -> overrides
    reads: tuple[str, ...] = ()     # files or folders (from the root) the chapter reads: in its source key
    part: str = "Chapters"          # the table of contents' part: "Chapters" (numbered) or "Appendices"
    nbval_cost: int = 1             # relative seconds under nbval: `make test` starts the costliest first
    # (name, parameters) -> the computations it compiles (`gradtie.book.workloads`): the memory plan
    workloads: Optional[Callable[[str, dict[str, Any]], list]] = None


# THE chapter list, in book order: the table of contents (`toc`), nbval's order (`nbval_order`),
# the build, the plots' modules and the benchmark's memory plan (`workloads`) all read it. Each chapter's
# notebook holds the ci defaults in its parameters cell, and a profile overrides a few of them
# (cpu: larger CPU runs; gpu: ImageNet shapes where they apply).
CHAPTERS: list[Chapter] = [
    Chapter("pools", "Pools", profiles={"cpu": {"batch": 16}, "gpu": {"batch": 64, "image_size": 224}},
            nbval_cost=72, workloads=workloads.pools),
    Chapter("head_fold", "Head fold", profiles={"cpu": {"num_classes": 100}, "gpu": {"num_classes": 1000}},
            nbval_cost=10, workloads=workloads.head_fold),
    Chapter("stage_germs", "Stage germs",
            profiles={"cpu": {"directions": 6, "batch": 4}, "gpu": {"directions": 9, "batch": 8}}, nbval_cost=160,
            workloads=workloads.stage_germs),
    Chapter("whole_net_tie", "Whole-net tie",
            profiles={"cpu": {"batch": 16, "fd_nodes": 24},
                      "gpu": {"batch": 128, "num_classes": 1000, "fd_nodes": 0}}, nbval_cost=150, workloads=workloads.whole_net_tie),
    Chapter("stage_by_stage", "Stage by stage",
            profiles={"cpu": {"batch": 16, "image_size": 64, "resnet_batch": 4, "every_n": True},
                      "gpu": {"batch": 128, "image_size": 224, "resnet_batch": 64, "num_classes": 1000,
                              "every_n": True}}, nbval_cost=200, workloads=workloads.stage_by_stage),
    Chapter("would_it_catch", "Would the check catch it?",
            profiles={"cpu": {"batch": 8, "resnet_batch": 4, "replicas": 4},
                      "gpu": {"batch": 32, "resnet_batch": 8, "image_size": 64, "replicas": 4}}, nbval_cost=192,
            workloads=workloads.would_it_catch),
    Chapter("check_your_own", "Check your own backward",
            profiles={"cpu": {"batch": 8}, "gpu": {"batch": 32, "image_size": 224}}, reads=("examples",),
            nbval_cost=90, workloads=workloads.check_your_own),
    Chapter("bf16_erasure", "bf16 erasure",
            profiles={"cpu": {"batch": 8, "image_size": 64}, "gpu": {"batch": 32, "image_size": 224, "replicas": 4}},
            nbval_cost=60, workloads=workloads.bf16_erasure),
    Chapter("bf16_rounding", "bf16 at real rounding",
            profiles={"cpu": {"batch": 8, "image_size": 64}, "gpu": {"batch": 32, "image_size": 224}},
            nbval_cost=70, workloads=workloads.bf16_erasure),
    Chapter("data_parallel", "Data-parallel tie",
            {"cpu": {"batch": 4, "replicas": 8}, "gpu": {"batch": 4, "replicas": 8, "image_size": 64}},
            nbval_cost=250, workloads=workloads.data_parallel),
    Chapter("training", "Training with the rendered step",
            {"cpu": {"batch": 64, "epochs": 8, "steps": 100},
             "gpu": {"net": "resnet34", "batch": 64, "epochs": 8, "steps": 100}}, part="Appendices", nbval_cost=315,
            workloads=workloads.training),
    Chapter("performance", "Performance",
            {"cpu": {"batch": 8, "image_size": 64}, "gpu": {"batch": 64, "image_size": 224}},
            reads=("benchmarks/results",), part="Appendices", nbval_cost=26, workloads=workloads.performance),
]
PROFILES = ("ci", "cpu", "gpu")
PAGES = ("glossary", "api")   # book/<page>.md after the appendices: the glossary, the API reference


def toc() -> str:
    """_toc.yml, from CHAPTERS: the intro, the numbered chapters, the appendices, the pages."""
    lines = ["format: jb-book", "root: book/intro", "parts:"]
    for part, numbered in (("Chapters", "true"), ("Appendices", "false")):
        lines += [f"  - caption: {part}", f"    numbered: {numbered}", "    chapters:"]
        lines += [f"      - file: book/{c.name}" for c in CHAPTERS if c.part == part]
        if part == "Appendices":
            lines += [f"      - file: book/{page}" for page in PAGES]
    return "\n".join(lines) + "\n"


def nbval_order() -> list[Path]:
    """The committed chapter notebooks, costliest first: nbval's order, so the workers end together."""
    return [NOTEBOOKS / f"{c.name}.ipynb" for c in sorted(CHAPTERS, key=lambda c: -c.nbval_cost)]


# ---- parameter validation: a clear error naming the parameter, the value and what is allowed ----

class _Rule:
    """A parameter's check, with the range it allows in words (the README's table reads it)."""

    def __init__(self, allows: str, check: Callable[[str, Any], Any]):
        self.allows, self.check = allows, check

    def __call__(self, name: str, value: Any) -> Any:
        return self.check(name, value)


def _choice(*allowed):
    def check(name, v):
        if v not in allowed:
            raise ValueError(f"parameter {name}={v!r}: expected one of {', '.join(map(repr, allowed))}")
        return v
    return _Rule(" / ".join(map(repr, allowed)), check)


def _int(lo: int, hi: Optional[int] = None, multiple_of: int = 1):
    rng = f"≥ {lo}" if hi is None else f"{lo}…{hi}"
    extra = f", a multiple of {multiple_of}" if multiple_of > 1 else ""

    def check(name, v):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"parameter {name}={v!r}: expected an integer")
        if v < lo or (hi is not None and v > hi) or v % multiple_of:
            raise ValueError(f"parameter {name}={v!r}: expected an integer {rng if hi is None else 'in ' + rng}{extra}")
        return v
    return _Rule(rng + extra, check)


def _float(lo: float, hi: float):
    def check(name, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            raise ValueError(f"parameter {name}={v!r}: expected a number in [{lo}, {hi}]")
        return float(v)
    return _Rule(f"[{lo:g}, {hi:g}]", check)


def _folder_or_empty(name, v):
    if not isinstance(v, str) or (v and not Path(v).expanduser().is_dir()):
        raise ValueError(f"parameter {name}={v!r}: expected '' (skip) or an existing folder")
    return v


def _bool(name, v):
    if not isinstance(v, bool):
        raise ValueError(f"parameter {name}={v!r}: expected True or False")
    return v


PARAMETERS: dict[str, Callable[[str, Any], Any]] = {
    "net": _choice("cifar8", "resnet34"),
    "batch": _int(1, 4096),
    "image_size": _int(32, 512, multiple_of=32),
    "num_classes": _int(2, 100_000),
    "head_width": _int(1, 65_536),
    "dtype": _choice("float64", "float32"),
    "data": _choice("photos", "flat", "randn", "digits"),
    "seed": _int(0),
    "label_smoothing": _float(0.0, 1.0),
    "directions": _int(1, 1000),
    "replicas": _int(1, 1024),
    "steps": _int(1, 10_000_000),
    "epochs": _int(1, 10_000),
    "lr": _float(0.0, 100.0),
    "bf16": _Rule("True / False", _bool),
    "conv_bias": _Rule("True / False", _bool),
    "resnet_batch": _int(1, 4096),     # ResNet-34 examples where a chapter runs both nets
    "statement_batch": _int(1, 4096),  # ResNet-34 examples at the statements' own 224 px
    "tie_batch": _int(1, 4096),        # examples per step in a step tie (Training)
    "fd_nodes": _int(0, 100_000),      # nodes checked by finite differences (0: every node)
    "cifar10_path": _Rule("'' or a folder", _folder_or_empty),  # CIFAR-10 files; '' skips them
    "weights": _choice("drawn"),       # chapters tie at drawn γ, β, biases: at init (γ = 1, β = 0) some bugs hide
    "every_n": _Rule("True / False", _bool),   # a sweep over N: every N of 1…8 (False: 1, 2, 4)
    "policy": _choice("bf16", "tf32"),   # a fast execution policy (`gradtie.policy`) a chapter ties
}


def parameters_cell(name: str) -> dict[str, tuple[str, Any, str]]:
    """A chapter's parameters cell (its jupytext source): {name: (type, ci default, comment)}."""
    import ast
    text = (NOTEBOOKS / f"{name}.py").read_text()
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("# %%"):
            if inside:
                break
            inside = "parameters" in line
            continue
        if inside:
            lines.append(line)
    out = {}
    for node, line in zip(ast.parse("\n".join(lines)).body, [ln for ln in lines if ln.strip()]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            comment = line.split("#", 1)[1].strip() if "#" in line else ""
            out[node.target.id] = (ast.unparse(node.annotation), ast.literal_eval(node.value), comment)
    return out


def _injected() -> list[str]:
    """The names papermill injected into this kernel (its "# Parameters" cell), or [] outside one."""
    try:
        from IPython import get_ipython
    except ImportError:
        return []
    shell = get_ipython()
    if shell is None:
        return []
    import ast
    names = []
    for source in shell.user_ns.get("In", []):
        if source.lstrip().startswith(("# Parameters", "# Injected parameters")):
            names += [t.id for node in ast.parse(source).body if isinstance(node, ast.Assign)
                      for t in node.targets if isinstance(t, ast.Name)]
    return names


def parameters_table() -> str:
    """The README's table of every chapter's parameters: name, type, range, ci, cpu and gpu values."""
    lines = ["| chapter | parameter | type | allowed | ci | cpu | gpu |", "|---|---|---|---|---|---|---|"]
    for c in CHAPTERS:
        for name, (kind, default, _) in parameters_cell(c.name).items():
            rule = PARAMETERS.get(name)
            cpu, gpu = (c.profiles.get(prof, {}).get(name, default) for prof in ("cpu", "gpu"))
            lines.append(f"| {c.name} | `{name}` | {kind} | {getattr(rule, 'allows', '')} | {default!r} | {cpu!r} | "
                         f"{gpu!r} |")
    return "\n".join(lines)


def validated(**params) -> SimpleNamespace:
    """Check each chapter parameter by name; raise ValueError naming the first bad one, and naming
    any parameter papermill was handed that the chapter does not have (papermill itself only warns).
    In a kernel, every later failing assert then names its values and these parameters
    (`assertions.explain_asserts`), and every later printed line fits the page's column
    (`fit_column`)."""
    unknown = [name for name in _injected() if name not in params]
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(map(repr, unknown))} for this chapter; its parameters "
                         f"are {', '.join(params)}")
    out = {}
    for name, value in params.items():
        if name not in PARAMETERS:
            raise ValueError(f"unknown chapter parameter {name!r}; known: {', '.join(sorted(PARAMETERS))}")
        out[name] = PARAMETERS[name](name, value)
    explain_asserts(out)
    fit_column()
    return SimpleNamespace(**out)


# ---- the page's column: what a chapter prints wraps to fit it -----------------------------------

# Characters of code or output the book's content column holds: 784 px of column, less the code
# block's padding, at the theme's 14 px monospace (about 8.4 px a character). Chapter sources keep
# their code to it (`tools/fit_columns.py`), and tests/test_book.py holds the executed chapters to it.
COLUMN = 88


class _FitColumn:
    """A text stream that passes every line through, a line wider than `width` wrapped at spaces
    with a hanging indent (or, a word wider than the column, cut)."""

    def __init__(self, stream, width: int = COLUMN):
        self._stream, self._width, self._pending = stream, width, ""

    def _wrap(self, line: str) -> str:
        if len(line) <= self._width:
            return line
        import textwrap

        lead = line[:len(line) - len(line.lstrip(" "))]
        return "\n".join(textwrap.wrap(line, self._width, subsequent_indent=lead + "    ",
                                        break_on_hyphens=False, replace_whitespace=False))

    def write(self, text: str) -> int:
        *whole, self._pending = (self._pending + text).split("\n")
        if whole:
            self._stream.write("".join(self._wrap(line) + "\n" for line in whole))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(self._wrap(self._pending))
            self._pending = ""
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def display_width(line: str) -> int:
    """Columns a line takes in monospace: combining marks (t̃'s tilde) take none."""
    import unicodedata

    return sum(not unicodedata.combining(ch) for ch in line)


RICH = ("text/html", "text/markdown", "image/png", "image/jpeg", "image/svg+xml")


def visible_lines(nb) -> Iterable[tuple[int, str, str]]:
    """(cell index, "code" or "output", line) for every line of code and text output the rendered
    page shows of an executed notebook (nbformat, or its JSON as a dict): not a cell's input under
    `remove-input` or `remove-cell`, nor its output under `remove-output` (stderr under
    `remove-stderr`), nor a text/plain the page replaces with HTML, Markdown or an image, nor a
    glued figure (stored, not shown). Folded input (`hide-input`) counts: a reader unfolds it."""
    for i, cell in enumerate(nb["cells"]):
        tags = set(cell.get("metadata", {}).get("tags", []))
        if cell["cell_type"] != "code" or "remove-cell" in tags:
            continue
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        if "remove-input" not in tags:
            yield from ((i, "code", line) for line in source.splitlines())
        if "remove-output" in tags:
            continue
        for out in cell.get("outputs", []):
            text = ""
            if out["output_type"] == "stream":
                if not (out.get("name") == "stderr" and "remove-stderr" in tags):
                    text = out["text"]
            elif out["output_type"] in ("display_data", "execute_result"):
                data = out.get("data", {})
                if "text/plain" in data and not any(k in data for k in RICH):
                    text = data["text/plain"]
            elif out["output_type"] == "error":
                text = "\n".join(out.get("traceback", []))
            text = text if isinstance(text, str) else "".join(text)
            yield from ((i, "output", line) for line in text.splitlines())


def wide_lines(path: Path, width: int = COLUMN) -> list[str]:
    """The visible lines of an executed notebook wider than the column (`visible_lines`), each as
    "<name> cell <i> <code|output> (<columns>): <line>"."""
    nb = json.loads(Path(path).read_text())
    return [f"{Path(path).name} cell {i} {kind} ({display_width(line)}): {line}"
            for i, kind, line in visible_lines(nb) if display_width(line) > width]


def fit_column(width: int = COLUMN) -> bool:
    """In an IPython kernel, wrap every line a later cell prints wider than the book's column
    (`COLUMN` characters) at spaces, with a hanging indent; tables meant for the page are shown
    with `gradtie.book.pages` instead, which never needs it. Outside a kernel (a script, a terminal, the
    tests) do nothing and return False."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    if get_ipython() is None:
        return False
    if isinstance(sys.stdout, _FitColumn):
        sys.stdout._width = width
    else:
        # the kernel's stdout goes through the wrapper for the rest of the session: the stdlib's
        # redirect, entered once and never left (the kernel ends with the chapter)
        contextlib.redirect_stdout(_FitColumn(sys.stdout, width)).__enter__()
    return True


# ---- glue: a chapter's headline figures, pasted into the intro's claim map ----------------------

GLUE_KEY = r"[a-z][a-z0-9_]*"
POINT_MIME = "text/x-gradtie-point"    # the glued record's second mime type: the figure's points, as JSON
ROLES = ("evidence", "control")


@dataclass(frozen=True)
class At:
    """The point a glued figure was computed at: what the claim map holds a statement's literal
    sizes and hypotheses against (`gradtie.book.claims.point_problems`).

    net: the net ("cifar8", "resnet34"; another name for anything else: "bottleneck example",
    "conv kinds", "logits"); image_size: the input side in px; batch: N (a tuple for a sweep);
    classes: K; alpha: the label smoothing α of the loss cotangent (None: no loss, or a random
    cotangent); data: "photos", "randn", "flat", "randn, β lifted", …; dtype; weights: "drawn" or
    "init"; replicas: R on a mesh (a tuple for a sweep); census: the smooth-point census at the
    point, hypothesis key -> holds ("parameters", "resnet34_input", "cifar8_input", "relu": no ReLU
    input exactly 0; `census_verdicts`), None where none was taken; role: "evidence", or "control"
    for a point a control (a planted bug, a refusal) runs at; extra: anything else that fixes the
    point (conv_bias, widths, …)."""
    net: str
    image_size: Optional[int] = None
    batch: Any = None
    classes: Optional[int] = None
    alpha: Optional[float] = None
    data: Optional[str] = None
    dtype: Optional[str] = None
    weights: Optional[str] = None
    replicas: Any = None
    census: Optional[dict[str, bool]] = None
    role: str = "evidence"
    extra: Optional[dict[str, Any]] = None

    def __post_init__(self):
        if not isinstance(self.net, str) or not self.net:
            raise ValueError(f"At: net must be a non-empty name, got {self.net!r}")
        if self.role not in ROLES:
            raise ValueError(f"At: role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.image_size is not None and (isinstance(self.image_size, bool) or not isinstance(self.image_size, int)):
            raise ValueError(f"At: image_size must be an integer (px) or None, got {self.image_size!r}")
        if self.census is not None and not all(isinstance(k, str) and isinstance(v, bool)
                                               for k, v in self.census.items()):
            raise ValueError(f"At: census must map hypothesis keys to True/False, got {self.census!r}")

    def as_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "At":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"At: unknown field(s) {unknown}; expected {sorted(names)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def describe(self) -> str:
        """One line: "resnet34, 224 px, N = 2, K = 10, α = 0.1, randn, float64, drawn"."""
        parts = [self.net]
        for label, v in (("{} px", self.image_size), ("N = {}", self.batch), ("R = {}", self.replicas),
                         ("K = {}", self.classes), ("α = {}", self.alpha)):
            if v is not None:
                parts.append(label.format(", ".join(map(str, v)) if isinstance(v, tuple) else v))
        parts += [v for v in (self.data, self.dtype, self.weights) if v]
        return ", ".join(parts) + ("" if self.role == "evidence" else f" ({self.role})")


def census_verdicts(report) -> dict[str, bool]:
    """A smooth-point census (`gradtie.checks.census.SmoothReport`) as `At.census`: each hypothesis
    that applies to the net by key, "relu" (no ReLU input exactly 0) and "windows" (every pool window
    dead, strict or tied only between twins)."""
    out = {h.key: bool(h.holds) for h in report.hypotheses}
    out["relu"] = int(report.zeros) == 0
    out["windows"] = int(report.non_twin_ties) == 0
    return out


class _Glued:
    """What `glue` stores: the figure's text as text/plain (what {glue:text} pastes) and, as
    POINT_MIME, the text with the points it was computed at (JSON)."""

    def __init__(self, text: str, points: tuple[At, ...]):
        self.text, self.points = text, points

    def __repr__(self) -> str:
        return repr(self.text)

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = {"text/plain": repr(self.text)}
        if self.points:
            bundle[POINT_MIME] = json.dumps({"text": self.text, "at": [p.as_dict() for p in self.points]},
                                            ensure_ascii=False, sort_keys=True)
        return bundle


def _points(key: str, at) -> tuple[At, ...]:
    if at is None:
        return ()
    points = (at,) if isinstance(at, At) else tuple(at)
    if not points or not all(isinstance(p, At) for p in points):
        raise ValueError(f"glue {key!r}: at must be an At or a non-empty sequence of At, got {at!r}")
    return points


def glue(key: str, value: Any, fmt: str = "{}", *, at=None) -> str:
    """Format a figure the chapter has computed and asserted, store it for the book under `key` and
    return the text, for the chapter to print.

    `fmt` is a `str.format` template; a tuple `value` fills its fields in order. `at`: the point
    (an `At`, or several) the figure was computed at, stored with it (POINT_MIME) for the claim
    map's checks. The text is stored with `myst_nb.glue(key, …, display=False)`, so the cell shows
    nothing more and the intro's claim map (`gradtie.book.claims`) pastes it from the executed chapter
    with {glue:text}`<chapter>.ipynb::<key>:s` (the trailing `:s` is needed: without a format spec
    myst-nb 1.4 reads `<chapter>.ipynb:` as the key). Outside a notebook kernel nothing is stored.
    """
    if not isinstance(key, str) or not re.fullmatch(GLUE_KEY, key):
        raise ValueError(f"glue key {key!r}: expected lower-case letters, digits and underscores, "
                         f"starting with a letter")
    if not isinstance(fmt, str):
        raise ValueError(f"glue {key!r}: fmt={fmt!r}, expected a str.format template such as '{{:.2f}}'")
    points = _points(key, at)
    try:
        text = fmt.format(*value) if isinstance(value, tuple) else fmt.format(value)
    except (IndexError, KeyError, ValueError) as exc:
        raise ValueError(f"glue {key!r}: fmt={fmt!r} cannot format {value!r} ({exc})") from None
    try:
        from IPython import get_ipython
    except ImportError:                 # the package alone, no notebook tooling installed
        return text
    if get_ipython() is not None:
        import myst_nb

        myst_nb.glue(key, _Glued(text, points) if points else text, display=False)
    return text


def glue_figure(key: str, fig) -> None:
    """Store a figure the chapter draws for another page to show (the intro's headline figure:
    ```{glue:any} <key>``` with `:doc: <chapter>.ipynb`); the cell shows it as usual with
    `plt.show()`. Outside a notebook kernel nothing is stored."""
    if not isinstance(key, str) or not re.fullmatch(GLUE_KEY, key):
        raise ValueError(f"glue key {key!r}: expected lower-case letters, digits and underscores, "
                         f"starting with a letter")
    try:
        from IPython import get_ipython
    except ImportError:
        return
    if get_ipython() is not None:
        import myst_nb

        myst_nb.glue(key, fig, display=False)


def glued(path: Path) -> dict[str, tuple[str, tuple[At, ...]]]:
    """Every figure an executed notebook glued: key -> (text, the points it was computed at; () when
    it recorded none)."""
    import ast

    nb = json.loads(Path(path).read_text())
    out = {}
    prefix = "application/papermill.record/"
    for cell in nb.get("cells", []):
        for output in cell.get("outputs", []):
            name = output.get("metadata", {}).get("scrapbook", {}).get("name")
            if name is None:
                continue
            data = output.get("data", {})
            plain = data.get(prefix + "text/plain", "")
            plain = "".join(plain) if isinstance(plain, list) else plain
            text = ast.literal_eval(plain) if plain else ""
            raw = data.get(prefix + POINT_MIME)
            points: tuple[At, ...] = ()
            if raw is not None:
                record = json.loads("".join(raw) if isinstance(raw, list) else raw)
                points = tuple(At.from_dict(d) for d in record["at"])
            out[name] = (str(text), points)
    return out


def decade(value: float) -> str:
    """The decade a positive figure falls in, "[1e-07, 1e-06)": how a chapter prints for nbval a
    figure that follows the machine's measured round-off (it moves by a small factor between CPUs)."""
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"decade: expected a finite positive figure, got {value!r}")
    lo = math.floor(math.log10(v))
    return f"[{10.0 ** lo:.0e}, {10.0 ** (lo + 1):.0e})"


# ---- the build ---------------------------------------------------------------------------------

def chapter_parameters(chapter: Chapter, profile: str) -> dict[str, Any]:
    if profile not in PROFILES:
        raise ValueError(f"profile {profile!r}: expected one of {', '.join(PROFILES)}")
    return dict(chapter.profiles.get(profile, {}))


SOURCE_KEY = "gradtie"   # notebook metadata: {"source_key": ..., "parameters": ...}


def source_key(chapter: Chapter, parameters: dict[str, Any]) -> str:
    """A hash of everything a chapter's outputs are computed from: notebooks/<name>.py, every module
    of the package, the pinned requirements and pyproject, the files it reads (`Chapter.reads`: the
    Performance appendix reads the committed benchmark results), and the parameters. Equal keys,
    same computation."""
    files = [NOTEBOOKS / f"{chapter.name}.py", ROOT / "requirements.txt", ROOT / "pyproject.toml"]
    files += sorted((ROOT / "src" / "gradtie").rglob("*.py"))
    for read in chapter.reads:
        path = ROOT / read
        files += sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(json.dumps(parameters, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _stamp(path: Path, key: str, parameters: dict[str, Any]) -> None:
    import nbformat
    nb = nbformat.read(path, as_version=4)
    strip_volatile(nb)
    nb.metadata[SOURCE_KEY] = {"source_key": key, "parameters": parameters}
    nbformat.write(nb, path)


def _executed_with(path: Path, key: str) -> bool:
    """Whether `path` is a notebook executed from exactly the sources and parameters `key` hashes."""
    if not path.is_file():
        return False
    try:
        meta = json.loads(path.read_text()).get("metadata", {}).get(SOURCE_KEY, {})
    except (OSError, ValueError):
        return False
    return meta.get("source_key") == key


def execute(profile: str = "ci", chapters: Optional[Iterable[str]] = None, *, progress: bool = True,
            force: bool = False) -> list[Path]:
    """Run every chapter notebook with papermill into book/ at the profile's parameters.

    A chapter already executed from its present sources at these parameters (book/<name>.ipynb, or
    the committed notebooks/<name>.ipynb when those are its parameters) is reused, not re-run,
    unless `force`."""
    import papermill

    chosen = [c for c in CHAPTERS if chapters is None or c.name in set(chapters)]
    written = []
    for chapter in bar(chosen, desc=f"chapters ({profile})", enabled=progress):
        src = NOTEBOOKS / f"{chapter.name}.ipynb"
        dst = BOOK / f"{chapter.name}.ipynb"
        parameters = chapter_parameters(chapter, profile)
        key = source_key(chapter, parameters)
        if not force and _executed_with(dst, key):     # book/ holds it from these sources already
            written.append(dst)
            continue
        if not force and _executed_with(src, key):     # the committed chapter is current
            shutil.copyfile(src, dst)
        else:
            papermill.execute_notebook(str(src), str(dst), parameters=parameters,
                                       kernel_name="python3", cwd=str(NOTEBOOKS), progress_bar=False)
            _stamp(dst, key, parameters)
        written.append(dst)
    return written


VOLATILE_METADATA = ("papermill", "execution")


def strip_volatile(nb) -> None:
    """Drop papermill timings and execution timestamps so a re-run changes only what it computed."""
    nb.metadata.pop("papermill", None)
    for cell in nb.cells:
        for key in VOLATILE_METADATA:
            cell.metadata.pop(key, None)


def source_notebook(name: str, dst: Path) -> Path:
    """Write notebooks/<name>.py (jupytext py:percent, the reviewed source), unexecuted, to `dst`."""
    import jupytext
    import nbformat

    nb = jupytext.read(NOTEBOOKS / f"{name}.py")
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata.pop("jupytext", None)
    nbformat.write(nb, dst)
    return dst


def source_drift(source: Path, executed: Path) -> list[str]:
    """Where an executed chapter (notebooks/<name>.ipynb, what nbval re-runs) no longer holds its
    reviewed source (notebooks/<name>.py): a cell count, a cell's kind, source or tags that differ.
    Empty when nbval runs exactly the code the source shows."""
    import jupytext
    src, nb = jupytext.read(source), json.loads(executed.read_text())
    if len(src.cells) != len(nb["cells"]):
        return [f"{executed.name}: {len(nb['cells'])} cells against {len(src.cells)} in {source.name}"]
    out = []
    for i, (a, b) in enumerate(zip(src.cells, nb["cells"])):
        tags_a, tags_b = sorted(a.metadata.get("tags", [])), sorted(b.get("metadata", {}).get("tags", []))
        what = [w for w, differs in (("kind", a.cell_type != b["cell_type"]),
                                     ("source", a.source != "".join(b["source"])),
                                     ("tags", tags_a != tags_b)) if differs]
        if what:
            out.append(f"{executed.name} cell {i}: {', '.join(what)} differ from {source.name}")
    return out


def refresh(name: str) -> Path:
    """notebooks/<name>.py (jupytext py:percent, the reviewed source) -> executed notebooks/<name>.ipynb.

    The executed notebook, at the ci defaults, is what nbval compares against in `make test`.
    """
    import papermill

    dst = source_notebook(name, NOTEBOOKS / f"{name}.ipynb")
    papermill.execute_notebook(str(dst), str(dst), kernel_name="python3", cwd=str(NOTEBOOKS),
                               progress_bar=False)
    chapter = next((c for c in CHAPTERS if c.name == name), Chapter(name, name))
    _stamp(dst, source_key(chapter, {}), {})
    return dst


def chapter_notebooks() -> list[Path]:
    """The committed executed notebooks nbval re-runs, one per chapter, in book order; ValueError when
    the chapters, the table of contents and the committed notebooks disagree (so that `make test`
    can never pass having collected fewer notebooks than the book has chapters)."""
    problems = [] if (ROOT / "_toc.yml").read_text() == toc() else ["_toc.yml is not book.toc() (run `gradtie book`)"]
    for chapter in CHAPTERS:
        for suffix in (".py", ".ipynb"):
            if not (NOTEBOOKS / f"{chapter.name}{suffix}").is_file():
                problems.append(f"notebooks/{chapter.name}{suffix} is missing")
    listed = {c.name for c in CHAPTERS}
    strays = sorted(f.stem for f in NOTEBOOKS.glob("*.ipynb") if f.stem not in listed)
    problems += [f"notebooks/{name}.ipynb is not a chapter in book.CHAPTERS" for name in strays]
    if problems:
        raise ValueError("the book's chapters disagree: " + "; ".join(problems))
    return [NOTEBOOKS / f"{c.name}.ipynb" for c in CHAPTERS]


def render() -> None:
    """jupyter-book build from a clean _build, -W -n --keep-going: any warning fails the build."""
    shutil.rmtree(ROOT / "_build", ignore_errors=True)
    (ROOT / "_toc.yml").write_text(toc())
    jb = Path(sys.executable).with_name("jupyter-book")
    subprocess.run([str(jb), "build", str(ROOT), "-W", "-n", "--keep-going"], check=True)
