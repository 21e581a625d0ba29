"""Autodiff stays with the oracle, behaviour is a value, and the rendered step, the oracle and the
envelope spread are each written once: scans of the source text of `gradtie`.

- The kernels (ops/, nets/, kit.py, rendered.py) never mention autodiff, not even in a comment:
  a plain text scan finds nothing there.
- In the whole package, JAX's autodiff is called only in reference.py and checks/ (the oracle, and
  the checks that call it; the bf16 reference rounding's custom_vjp lives in checks/bf16/).
- No `setattr(`, `mock.patch`, `patch.object`, `id(` or assignment to another module's attribute
  anywhere in src/gradtie (code only: comments and strings may say what is not done).
- The rendered step (`def step` at module level), the oracle (`def oracle`) and the envelope spread
  (`def spread`) are each defined once, no module but reference.py calls `jax.value_and_grad` or
  `jax.vjp`, and every consumer calls `gradtie.rendered`.

Each scanner is shown catching a planted snippet, so a scan that passes is a scan that could fail.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gradtie"

# ---- the scanners --------------------------------------------------------------------------------

# the kernels: any mention at all, in code, comments or docstrings
MENTION = re.compile(r"\bjax\.(grad|vjp|jvp|linearize|value_and_grad|custom_vjp|custom_jvp)\b|"
                     r"\b(value_and_grad|custom_vjp|custom_jvp|linearize)\b|"
                     r"\b(grad|vjp|jvp)\s*\(|"
                     r"from jax(\.\w+)* import [^\n]*\b(grad|vjp|jvp|linearize|value_and_grad|custom_vjp)\b")
# the rest of the package: a call of JAX's autodiff in code (the oracle's own wrappers,
# `reference.value_and_grad` and `reference.vjp`, are how everyone else reaches it)
AUTODIFF_CALL = re.compile(r"\bjax\.(grad|vjp|jvp|linearize|value_and_grad|custom_vjp|custom_jvp)\b|"
                           r"(?<!reference\.)\b(value_and_grad|custom_vjp|custom_jvp)\b|"
                           r"from jax(\.\w+)* import [^\n]*\b(grad|vjp|jvp|linearize|value_and_grad|custom_vjp)\b")
PATCHING = re.compile(r"(?<![\w.])setattr\s*\(|\bmock\.patch\b|\bpatch\.object\b|(?<![\w.])id\s*\(")


def code_only(text: str) -> str:
    """The source with every comment and string literal blanked (line and column numbers kept)."""
    lines = text.splitlines(keepends=True)
    blank = {"COMMENT", "STRING", "FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END"}
    spans = [(t.start, t.end) for t in tokenize.generate_tokens(io.StringIO(text).readline)
             if tokenize.tok_name[t.type] in blank]
    chars = [list(line) for line in lines]
    for (r0, c0), (r1, c1) in spans:
        for r in range(r0, r1 + 1):
            row = chars[r - 1]
            start = c0 if r == r0 else 0
            end = c1 if r == r1 else len(row)
            for c in range(start, end):
                if row[c] != "\n":
                    row[c] = " "
    return "".join("".join(row) for row in chars)


def hits(pattern: re.Pattern, text: str) -> list[str]:
    return [f"{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if pattern.search(line)]


def rel(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def package_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def kernel_files() -> list[Path]:
    return (sorted((SRC / "ops").rglob("*.py")) + sorted((SRC / "nets").rglob("*.py"))
            + [SRC / "kit.py", SRC / "rendered.py"])


def oracle_side(path: Path) -> bool:
    r = rel(path)
    return r == "reference.py" or r.startswith("checks/")


# ---- autodiff ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", kernel_files(), ids=rel)
def test_kernel_module_never_mentions_autodiff(path):
    assert hits(MENTION, path.read_text()) == []


@pytest.mark.parametrize("path", [p for p in package_files() if not oracle_side(p)], ids=rel)
def test_autodiff_is_called_only_by_the_oracle_and_the_checks(path):
    assert hits(AUTODIFF_CALL, code_only(path.read_text())) == []


def test_the_oracle_side_does_call_autodiff():
    """The scan is not vacuous: reference.py and the bf16 reference rounding are where it lives."""
    assert hits(AUTODIFF_CALL, code_only((SRC / "reference.py").read_text()))
    assert any(hits(AUTODIFF_CALL, code_only(p.read_text())) for p in (SRC / "checks" / "bf16").rglob("*.py"))


@pytest.mark.parametrize("snippet", [
    "g = jax.grad(loss)(p)", "_, f = jax.vjp(fwd, x)", "from jax import vjp\nvjp(f, x)",
    "jax.linearize(f, x)", "from jax import grad as g", "@jax.custom_vjp", "jax.value_and_grad(f)",
    "jax.jvp(f, (x,), (t,))", "from jax import value_and_grad", "f = custom_vjp(g)",
])
def test_scans_catch_planted_autodiff(snippet):
    assert hits(MENTION, snippet), snippet
    assert hits(AUTODIFF_CALL, code_only(snippet)), snippet


@pytest.mark.parametrize("snippet", [
    "# we never call jax.vjp here", "'''differentiated by jax.grad'''", "x = reference.value_and_grad(f)(p)",
    "y = conv.grad_weight(x, dy)",
])
def test_the_call_scan_leaves_comments_strings_and_the_oracles_wrappers(snippet):
    assert hits(AUTODIFF_CALL, code_only(snippet)) == []


def test_the_mention_scan_reads_comments_too():
    assert hits(MENTION, "# checked against jax.vjp")
    assert hits(MENTION, '"""the value_and_grad of the loss"""')


def test_scan_covers_the_kernels():
    names = {rel(p) for p in kernel_files()}
    assert {"ops/conv.py", "ops/batchnorm.py", "ops/maxpool.py", "ops/relu.py", "ops/head.py",
            "nets/protocol.py", "nets/cifar8.py", "nets/resnet34.py", "kit.py", "rendered.py"} <= names


# ---- no patching, no identity caches, no module-attribute assignment -------------------------------

@pytest.mark.parametrize("path", package_files(), ids=rel)
def test_no_patching_and_no_cache_keyed_by_id(path):
    assert hits(PATCHING, code_only(path.read_text())) == []


@pytest.mark.parametrize("snippet", [
    "setattr(conv, 'backward', wrong)", "with mock.patch.object(conv, 'backward'):", "patch.object(m, 'f')",
    "cache[id(net)] = fn", "key = (id(opt), lr)",
])
def test_patching_scan_catches_planted_snippets(snippet):
    assert hits(PATCHING, code_only(snippet)), snippet


@pytest.mark.parametrize("snippet", ["# never keyed by id(net)", "x = valid(a)", "hypotheses_grid(points)",
                                     "object.__setattr__(self, 'a', 1)", "s = 'setattr(m, x)'"])
def test_patching_scan_leaves_comments_strings_and_other_names(snippet):
    assert hits(PATCHING, code_only(snippet)) == []


def module_names(tree: ast.Module, path: Path) -> set[str]:
    """Names a file binds to modules: `import a.b as n`, and `from <package> import n` where n is a
    module or package of gradtie."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
            elif (node.module or "").split(".")[0] == "gradtie":
                base = SRC.parent
            else:
                continue
            base = base.joinpath(*(node.module or "").split(".")) if node.module else base
            for a in node.names:
                if (base / f"{a.name}.py").is_file() or (base / a.name / "__init__.py").is_file():
                    names.add(a.asname or a.name)
    return names


def module_attribute_assignments(text: str, path: Path) -> list[str]:
    tree = ast.parse(text)
    modules = module_names(tree, path)
    out = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        while targets:   # unpack `a, m.x = …`; a subscript (`os.environ[k] = v`) assigns an item, not an attribute
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets += t.elts
            elif isinstance(t, ast.Starred):
                targets.append(t.value)
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in modules:
                out.append(f"{node.lineno}: {t.value.id}.{t.attr}")
    return out


@pytest.mark.parametrize("path", package_files(), ids=rel)
def test_no_module_attribute_is_assigned(path):
    assert module_attribute_assignments(path.read_text(), path) == []


def test_module_attribute_scan_catches_a_planted_assignment():
    path = SRC / "checks" / "example.py"
    assert module_attribute_assignments("from ..ops import conv\nconv.backward = wrong\n", path) == ["2: conv.backward"]
    assert module_attribute_assignments("import gradtie.ops.conv as c\nc.X += 1\n", path) == ["2: c.X"]
    assert module_attribute_assignments("import sys\na, sys.x = 1, 2\n", path) == ["2: sys.x"]
    assert module_attribute_assignments("from ..kit import KIT\nKIT.x = 1\n", path) == []   # KIT is no module
    assert module_attribute_assignments("import os\nos.environ['A'] = '1'\n", path) == []   # an item, not an attribute


# ---- the rendered step, the oracle and the envelope spread: each written once ------------------------

def parsed() -> dict[str, ast.Module]:
    return {rel(p): ast.parse(p.read_text()) for p in package_files()}


def module_level_defs(trees: dict[str, ast.Module], name: str) -> list[str]:
    return sorted(r for r, tree in trees.items()
                  if any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body))


def jax_calls(tree: ast.Module, names: set[str]) -> list[str]:
    """Calls `jax.<name>(…)`, or `<name>(…)` of a name imported from jax, in a module."""
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.module or "").split(".")[0] == "jax" for a in n.names if a.name in names}
    out = []
    for n in ast.walk(tree):
        f = getattr(n, "func", None) if isinstance(n, ast.Call) else None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "jax" and f.attr in names:
            out.append(f"{n.lineno}: jax.{f.attr}")
        elif isinstance(f, ast.Name) and f.id in imported:
            out.append(f"{n.lineno}: {f.id}")
    return out


RUNNERS = {"step", "compiled", "quick", "taped", "run", "forward"}


def calls_rendered(tree: ast.Module) -> bool:
    """The module calls one of `gradtie.rendered`'s runners: `rendered.step(…)` and the like, or a
    runner imported from it by name."""
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.module or "").split(".")[-1] == "rendered" for a in n.names if a.name in RUNNERS}
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "rendered"
                    and f.attr in RUNNERS):
                return True
            if isinstance(f, ast.Name) and f.id in imported:
                return True
            # a runner handed on as a value, e.g. partial(rendered.quick, …)
            for a in n.args:
                if (isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "rendered"
                        and a.attr in RUNNERS):
                    return True
    return False


CONSUMERS = ("checks/tie.py", "checks/census.py", "checks/germs.py", "checks/stages.py", "checks/fd.py",
             "train.py", "parallel.py", "bench.py", "checks/bf16/")


def test_the_rendered_step_oracle_and_envelope_spread_are_each_defined_once():
    trees = parsed()
    assert module_level_defs(trees, "step") == ["rendered.py"]
    assert module_level_defs(trees, "oracle") == ["reference.py"]
    assert module_level_defs(trees, "spread") == ["checks/envelope.py"]


def test_only_the_oracle_calls_value_and_grad_or_vjp():
    trees = parsed()
    callers = {r: c for r, tree in trees.items() if (c := jax_calls(tree, {"value_and_grad", "vjp"}))}
    assert list(callers) == ["reference.py"], callers


def test_the_unit_roundoff_nudge_is_written_once():
    """a·(1 + u·ξ): the envelope's nudge, in checks/envelope.py only."""
    nudge = re.compile(r"1\s*\+\s*u\s*\*")
    where = sorted(rel(p) for p in package_files() if hits(nudge, code_only(p.read_text())))
    assert where == ["checks/envelope.py"]


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_every_consumer_runs_the_one_rendered_step(consumer):
    trees = parsed()
    modules = [r for r in trees if r == consumer or (consumer.endswith("/") and r.startswith(consumer))]
    assert modules, f"{consumer}: no such module"
    assert any(calls_rendered(trees[r]) for r in modules), f"{consumer} never calls gradtie.rendered"


@pytest.mark.parametrize("source, defines_step, calls, runs", [
    ("def step(net, kit):\n    return net.backward()\n", True, [], False),
    ("import jax\ndef f(g):\n    return jax.value_and_grad(g)\n", False, ["3: jax.value_and_grad"], False),
    ("from jax import vjp as v\ny = v(f, x)\n", False, ["2: v"], False),
    ("from .. import rendered\nout = rendered.step(net, kit, p, x, t, cfg)\n", False, [], True),
    ("from ..rendered import compiled\nout = compiled(net, kit, p, x, t, cfg)\n", False, [], True),
    ("from .. import rendered\nQ = rendered.QUICK\n", False, [], False),    # importing it is not running it
])
def test_the_structural_checks_can_fail(source, defines_step, calls, runs):
    tree = ast.parse(source)
    assert (module_level_defs({"m.py": tree}, "step") == ["m.py"]) == defines_step
    assert jax_calls(tree, {"value_and_grad", "vjp"}) == calls
    assert calls_rendered(tree) == runs
