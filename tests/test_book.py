"""The book's chapters, table of contents and committed notebooks agree, so that nbval can never
pass having collected fewer notebooks than the book has chapters; parameters validate; the intro's
claim map is the rendered one, and every figure it pastes is glued by its chapter."""

import json
import re

import pytest

from gradtie import book
from gradtie.book import claims


def _tree(tmp_path, names, toc_names, ipynbs):
    (tmp_path / "notebooks").mkdir()
    # the table of contents book.toc() writes, with only `toc_names` of the chapters in it
    (tmp_path / "_toc.yml").write_text("".join(line + "\n" for line in book.toc().splitlines()
                                               if "file: book/" not in line or line.split("book/")[1] in toc_names
                                               or line.split("book/")[1] in book.PAGES))
    for n in names:
        (tmp_path / "notebooks" / f"{n}.py").write_text("")
    for n in ipynbs:
        (tmp_path / "notebooks" / f"{n}.ipynb").write_text("{}")


@pytest.fixture
def two_chapters(monkeypatch, tmp_path):
    monkeypatch.setattr(book, "ROOT", tmp_path)
    monkeypatch.setattr(book, "NOTEBOOKS", tmp_path / "notebooks")
    monkeypatch.setattr(book, "CHAPTERS", [book.Chapter("a", "A"), book.Chapter("b", "B")])
    return tmp_path


def test_agreeing_book_lists_every_chapter_notebook(two_chapters):
    _tree(two_chapters, ["a", "b"], ["a", "b"], ["a", "b"])
    assert [p.name for p in book.chapter_notebooks()] == ["a.ipynb", "b.ipynb"]


def test_the_committed_toc_and_the_nbval_order_come_from_the_chapter_list():
    assert (book.ROOT / "_toc.yml").read_text() == book.toc()
    assert sorted(p.stem for p in book.nbval_order()) == sorted(c.name for c in book.CHAPTERS)
    costs = {c.name: c.nbval_cost for c in book.CHAPTERS}
    assert [costs[p.stem] for p in book.nbval_order()] == sorted(costs.values(), reverse=True)


@pytest.mark.parametrize("toc, ipynbs, message", [
    (["a"], ["a", "b"], "_toc.yml is not book.toc"),
    (["a", "b"], ["a"], "notebooks/b.ipynb is missing"),
    (["a", "b"], ["a", "b", "c"], "notebooks/c.ipynb is not a chapter"),
])
def test_a_missing_or_stray_notebook_fails(two_chapters, toc, ipynbs, message):
    _tree(two_chapters, ["a", "b"], toc, ipynbs)
    with pytest.raises(ValueError, match=message):
        book.chapter_notebooks()


@pytest.mark.parametrize("kwargs, message", [
    ({"batch": 0}, "batch=0"), ({"net": "vgg"}, "expected one of"), ({"unknown": 1}, "unknown chapter parameter"),
])
def test_bad_chapter_parameters_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        book.validated(**kwargs)


# ---- the claim map: the intro's table, the chapters' glue calls, the statements issue 10 lists ----

ISSUE_10_STATEMENTS = (
    "cifar8Bbn_net_lossGrad", "cifar8Bbn_net_lossGrad_CE", "cifar8Bbn_train_step_tiedB", "cifar8BbnInputGradB_correct",
    "maxPoolB_relu_eventuallyEq_sel", "batchMapAux_maxPoolBackFlat_eq_selScatter", "C8PoolTwin₁…₄", "c8_germ_stageₖ",
    "r34InputGradB_correct", "resnet34ForwardBFull_eq_slots", "r34IdCotIn_eq_vjp", "r34DownCotIn_eq_vjp",
    "the six-op head fold", "r34_net_tiedB", "r34_net_syncTiedB", "Bf16Erasure", "SyncBf16",
)
ISSUE_10_BEYOND = ("cifar8 input gradient at dead windows", "bf16 forward rounding and bounds", "cifar8 data parallel",
                   "float32 views", "the bug catalogue", "training accuracy")


def test_intro_table_is_the_rendered_claim_map():
    page = (book.BOOK / "intro.md").read_text()
    assert claims.between_markers(page) == claims.render_table()
    assert "including at the kinks" not in page


def test_every_statement_issue_10_lists_is_in_the_map():
    missing = [s for s in ISSUE_10_STATEMENTS
               if not any(s == c.name or s in c.statement for c in claims.SUITE)]
    assert missing == []
    assert not any(c.beyond_suite for c in claims.SUITE) and all(c.beyond_suite for c in claims.BEYOND)
    assert set(ISSUE_10_BEYOND) <= {c.name for c in claims.BEYOND}


def test_every_cited_section_and_figure_is_in_its_chapter():
    assert claims.problems() == []


def _chapter_copy(tmp_path, name):
    folder = tmp_path / "notebooks"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.py").write_text((book.NOTEBOOKS / f"{name}.py").read_text())
    return folder


def test_a_missing_figure_a_missing_section_and_a_twice_glued_key_are_named(tmp_path):
    head = [c for c in claims.CLAIMS if any(s.chapter == "head_fold" for s in c.shown)]
    folder = _chapter_copy(tmp_path, "head_fold")
    assert claims.problems(head, folder) == []
    source = (folder / "head_fold.py").read_text()
    broken = re.sub(r'book\.glue\(\s*"head_linear",', 'book.glue("fold_controls",',
                    source.replace('book.glue("fold_tied", ', "(")
                    .replace("# ## Planted bugs go red", "# ## Planted bugs"))
    (folder / "head_fold.py").write_text(broken)
    found = "\n".join(claims.problems(head, folder))
    assert "never calls book.glue('fold_tied'" in found
    assert "no section 'Planted bugs go red'" in found
    assert "book.glue('fold_controls', ...) is called 2 times" in found
    assert "never calls book.glue('head_linear'" in found


def test_a_table_cell_cannot_break_the_table():
    bad = claims.Claim("x", "a | b", "none", (claims.Shown("pools", "s", ("k",)),))
    with pytest.raises(ValueError, match="no '\\|'"):
        claims.render_table([bad])
    with pytest.raises(ValueError, match="not in book.CHAPTERS"):
        claims.render_table([claims.Claim("x", "x", "none", (claims.Shown("nowhere", "s"),))])


def _seeds():
    for folder in (book.ROOT / "shared" / "seeds", book.ROOT.parent / "shared" / "seeds"):
        if folder.is_dir():
            return "\n".join(p.read_text() for p in sorted(folder.glob("*.txt")))
    return None


def _lean_names(text: str) -> set[str]:
    """The Lean names a cell cites: each backquoted span's head, after a hypothesis label ("hq : R34PosB w"
    cites R34PosB); hypothesis labels (hq, hdy, …) and the rounding variable are the statements' own
    binder names, not Lean constants."""
    out = set()
    for span in re.findall(r"`([^`]+)`", text):
        head = span.split(" : ", 1)[-1].split()
        if head and not re.fullmatch(r"h[\wεα-ω]*|z?rnd", head[0]):
            out.add(head[0])
    return out


def test_the_maps_lean_names_are_spelled_as_the_seeds_spell_them():
    seeds = _seeds()
    if seeds is None:
        pytest.skip("the upstream suite's module docs (shared/seeds) are not beside this checkout")
    cited = {name for c in claims.SUITE for name in _lean_names(c.statement + " " + c.hypotheses)}
    assert len(cited) > 20
    assert sorted(n for n in cited if n not in seeds and n not in UPSTREAM_ONLY) == []


# Names the seeds do not spell out, read from the upstream statements themselves (brettkoonce/lean4-mlir):
# `r34IdCotIn_eq_vjp`/`r34DownCotIn_eq_vjp` (ResNet34StepTieB.lean) take `hq : R34IdPos p`/`R34DownPos p`
# and `hs : R34IdSmoothAt …`/`R34DownSmoothAt …`; `r34_net_lossGrad` (ResNet34ParamGrad) takes
# `hq : R34PosB w` and `hx : R34LossSmoothAtB N w x`; the head fold's lemma is
# `smoothedLossCotGraph_row` (Foundation/SmoothedLossCot.lean), read at ResNet-34's logits by
# `r34_lossCot_is_smoothedCE_grad` (ResNet34StepTieB.lean); Bf16Erasure.lean names its lemmas
# `convBf16_id`, `convWeightGradBBf16_id`, …; DataParallel/SyncBf16.lean states
# `den_allReduceMeanF_convWeightGradBBf16_shard` and `…_sub_global`.
UPSTREAM_ONLY = {"R34IdPos", "R34DownPos", "R34IdSmoothAt", "R34DownSmoothAt", "R34PosB", "R34LossSmoothAtB",
                 "smoothedLossCotGraph_row", "r34_lossCot_is_smoothedCE_grad", "convBf16_id", "convWeightGradBBf16_id",
                 "den_allReduceMeanF_convWeightGradBBf16_shard", "den_allReduceMeanF_convWeightGradBBf16_sub_global"}


def test_glue_formats_and_returns_the_text_and_stores_it_only_in_a_kernel(monkeypatch):
    import IPython
    import myst_nb

    stored = []
    monkeypatch.setattr(myst_nb, "glue", lambda *a, **k: stored.append((a, k)))
    assert book.glue("worst_err", 3.2e-13, "worst {:.0e}") == "worst 3e-13"
    assert stored == []                                    # no kernel under pytest: nothing stored
    monkeypatch.setattr(IPython, "get_ipython", lambda: object())
    assert book.glue("nodes_tied", (38, 38), "{}/{} nodes tied") == "38/38 nodes tied"
    assert book.glue("shape", (tuple((4, 3)),), "input {}") == "input (4, 3)"
    assert stored == [(("nodes_tied", "38/38 nodes tied"), {"display": False}),
                      (("shape", "input (4, 3)"), {"display": False})]


@pytest.mark.parametrize("key, value, fmt, message", [
    ("Bad-Key", 1, "{}", "glue key 'Bad-Key'"), ("k", 1, "{} and {}", "cannot format"),
    ("k", 1, 5, "expected a str.format template"), ("k", 1.5, "{:d}", "cannot format"),
])
def test_glue_refuses_bad_keys_and_formats(key, value, fmt, message):
    with pytest.raises(ValueError, match=message):
        book.glue(key, value, fmt)


def _misplaced_glue(paths):
    """Glue calls nbval would not compare (an untagged cell), or that show their text a second time
    (a bare book.glue(...) as the cell's last line)."""
    import ast

    import jupytext

    found = []
    for path in paths:
        for cell in jupytext.read(path).cells:
            if cell.cell_type != "code" or "book.glue(" not in cell.source:
                continue
            body = ast.parse(cell.source).body
            if "nbval-check-output" not in cell.metadata.get("tags", []):
                found.append(f"{path.name}: a cell nbval does not compare glues")
            if body and isinstance(body[-1], ast.Expr) and ast.unparse(body[-1]).startswith("book.glue("):
                found.append(f"{path.name}: a cell ends in a bare book.glue(...)")
    return found


def test_every_glue_call_sits_in_a_compared_cell_and_prints_nothing_twice():
    assert _misplaced_glue(sorted(book.NOTEBOOKS.glob("*.py"))) == []


def test_an_untagged_or_bare_glue_is_found(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('# %%\nx = 1\nprint(book.glue("a", x))\n\n# %% tags=["nbval-check-output"]\nbook.glue("b", 2)\n')
    assert _misplaced_glue([bad]) == ["bad.py: a cell nbval does not compare glues",
                                      "bad.py: a cell ends in a bare book.glue(...)"]


# ---- the execution cache: a chapter whose sources changed always re-executes -------------------------

@pytest.fixture
def one_chapter(tmp_path, monkeypatch):
    """head_fold alone, its committed notebook copied into a scratch notebooks/ and book/, and
    papermill replaced by a recorder that copies its input as the "executed" notebook."""
    import shutil as _shutil
    import papermill

    notebooks, out = tmp_path / "notebooks", tmp_path / "book"
    notebooks.mkdir(), out.mkdir()
    _shutil.copyfile(book.NOTEBOOKS / "head_fold.ipynb", notebooks / "head_fold.ipynb")
    monkeypatch.setattr(book, "NOTEBOOKS", notebooks)
    monkeypatch.setattr(book, "BOOK", out)
    runs = []

    def fake_execute(src, dst, **kwargs):
        runs.append(kwargs["parameters"])
        _shutil.copyfile(src, dst)
    monkeypatch.setattr(papermill, "execute_notebook", fake_execute)
    return notebooks / "head_fold.ipynb", out / "head_fold.ipynb", runs


def test_a_notebook_executed_from_the_present_sources_is_reused(one_chapter, monkeypatch):
    committed, executed, runs = one_chapter
    monkeypatch.setattr(book, "source_key", lambda c, p: "k-now")
    book._stamp(committed, "k-now", {})
    book.execute("ci", ["head_fold"], progress=False)
    assert runs == [] and executed.read_bytes() == committed.read_bytes()
    book.execute("ci", ["head_fold"], progress=False)         # book/ now holds it: still nothing runs
    assert runs == []
    book.execute("ci", ["head_fold"], progress=False, force=True)
    assert runs == [{}]


def test_a_changed_source_or_other_parameters_re_execute(one_chapter, monkeypatch):
    committed, executed, runs = one_chapter
    book._stamp(committed, "k-before", {})
    monkeypatch.setattr(book, "source_key", lambda c, p: "k-after")   # any source file changed
    book.execute("ci", ["head_fold"], progress=False)
    assert runs == [{}]
    assert book._executed_with(executed, "k-after") and not book._executed_with(committed, "k-after")
    monkeypatch.setattr(book, "source_key", lambda c, p: f"k-after {sorted(p)}")
    book.execute("cpu", ["head_fold"], progress=False)          # the cpu profile's parameters
    assert len(runs) == 2


@pytest.mark.parametrize("changed", ["notebooks/a.py", "src/gradtie/ops/x.py", "benchmarks/results/cpu.json",
                                     "requirements.txt", "pyproject.toml"])
def test_the_source_key_moves_with_every_input(tmp_path, monkeypatch, changed):
    for rel in ("notebooks/a.py", "notebooks/b.py", "src/gradtie/ops/x.py", "benchmarks/results/cpu.json",
                "requirements.txt", "pyproject.toml", "tests/test_x.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("v1")
    monkeypatch.setattr(book, "ROOT", tmp_path)
    monkeypatch.setattr(book, "NOTEBOOKS", tmp_path / "notebooks")
    a, b = book.Chapter("a", "A", reads=("benchmarks/results",)), book.Chapter("b", "B")
    key, key_b = book.source_key(a, {}), book.source_key(b, {})
    assert key == book.source_key(a, {}) and key != book.source_key(b, {})
    assert key != book.source_key(a, {"batch": 8})
    (tmp_path / "tests/test_x.py").write_text("v2")        # not an input of any chapter
    assert book.source_key(a, {}) == key
    (tmp_path / changed).write_text("v2")
    assert book.source_key(a, {}) != key
    # b reads no results: only its own source, the package and the pins move it
    assert (book.source_key(b, {}) == key_b) == (changed in ("notebooks/a.py", "benchmarks/results/cpu.json"))


def test_a_missing_or_corrupt_notebook_is_never_reused(tmp_path):
    assert not book._executed_with(tmp_path / "absent.ipynb", "k")
    (tmp_path / "bad.ipynb").write_text("{not json")
    assert not book._executed_with(tmp_path / "bad.ipynb", "k")


# ---- the executed chapters carry no stderr and no path of the machine that ran them -------------

_MACHINE_PATH = re.compile(r"(/home/|/root/|/tmp/|/work/|/Users/|\.venv/|site-packages/|[A-Z]:\\\\)")


def _outputs(path):
    for cell in json.loads(path.read_text())["cells"]:
        for out in cell.get("outputs", []):
            text = out.get("text", "") if out.get("output_type") == "stream" else out.get("data", {}).get("text/plain", "")
            yield out, "".join(text) if isinstance(text, list) else str(text)


def _problems(path) -> list[str]:
    found = []
    for out, text in _outputs(path):
        if out.get("output_type") == "stream" and out.get("name") == "stderr":
            found.append(f"stderr: {text[:60]!r}")
        if _MACHINE_PATH.search(text):
            found.append(f"a machine path: {text[:60]!r}")
    return found


@pytest.mark.parametrize("chapter", [c.name for c in book.CHAPTERS])
def test_an_executed_chapter_has_no_stderr_and_no_machine_path(chapter):
    assert _problems(book.NOTEBOOKS / f"{chapter}.ipynb") == []


def test_stderr_and_a_machine_path_are_found(tmp_path):
    nb = {"cells": [{"cell_type": "code", "outputs": [
        {"output_type": "stream", "name": "stderr", "text": ["TqdmWarning: IProgress not found\n"]},
        {"output_type": "stream", "name": "stdout", "text": ["read /home/user/.venv/lib/python3.11/x.py\n"]},
        {"output_type": "execute_result", "data": {"text/plain": "tied 38/38"}}]}]}
    (tmp_path / "x.ipynb").write_text(json.dumps(nb))
    found = _problems(tmp_path / "x.ipynb")
    assert len(found) == 2 and found[0].startswith("stderr") and found[1].startswith("a machine path")


def test_the_readme_parameter_table_is_generated_from_the_chapters():
    readme = (book.ROOT / "README.md").read_text()
    start, end = "(generated by gradtie.book.parameters_table; do not edit by hand) -->\n", "\n<!-- parameters:end -->"
    table = readme[readme.index(start) + len(start):readme.index(end)]
    assert table == book.parameters_table()
    every = {(c.name, name) for c in book.CHAPTERS for name in book.parameters_cell(c.name)}
    assert len(table.splitlines()) == 2 + len(every) and all(f"| `{n}` |" in table for _, n in every)


def test_every_chapter_parameter_is_typed_and_validated():
    for c in book.CHAPTERS:
        cell = book.parameters_cell(c.name)
        assert cell, c.name
        for name, (kind, default, _) in cell.items():
            assert kind in ("int", "float", "str", "bool") and type(default).__name__ == kind, (c.name, name)
            assert book.PARAMETERS[name](name, default) == default
        # papermill reads the same cell: every line parses (an "=" in a comment breaks its parser,
        # and the parameter then shows no type under --help-notebook)
        from papermill.translators import PythonTranslator
        source = "\n".join(f"{n}: {k} = {d!r}  # {comment}" for n, (k, d, comment) in cell.items())
        seen = {p.name: p.inferred_type_name for p in PythonTranslator.inspect({"source": source})}
        assert seen == {n: k for n, (k, _, _) in cell.items()}, (c.name, seen)


def test_an_unknown_injected_parameter_names_the_chapter_s_parameters(monkeypatch):
    monkeypatch.setattr(book, "_injected", lambda: ["batch", "bacth"])
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) 'bacth' for this chapter; its parameters are batch, seed"):
        book.validated(batch=4, seed=0)
    monkeypatch.setattr(book, "_injected", lambda: ["batch"])
    assert book.validated(batch=4, seed=0).batch == 4


def test_decade_names_the_decade_a_figure_falls_in_and_refuses_what_has_none():
    assert book.decade(3e-7) == book.decade(6e-7) == "[1e-07, 1e-06)"
    assert book.decade(1e-6) == "[1e-06, 1e-05)"       # a power of ten opens its decade
    assert book.decade(2e-6) != book.decade(3e-7)
    for bad in (0.0, -1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite positive"):
            book.decade(bad)


# ---- the page's column: no code or output line runs off it ------------------------------------

def _source_code_lines(path):
    """(line number, line) of each line of code (not markdown, not the header) in a chapter source."""
    kind = "header"
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("# %%"):
            kind = "markdown" if "[markdown]" in line else "code"
        elif kind == "code":
            yield n, line


def test_chapter_sources_keep_their_code_to_the_column():
    wide = [f"{p.name}:{n} ({book.display_width(line)})" for p in sorted(book.NOTEBOOKS.glob("*.py"))
            for n, line in _source_code_lines(p) if book.display_width(line) > book.COLUMN]
    assert wide == [], "run tools/fit_columns.py on these chapter sources"


def test_no_visible_line_of_an_executed_chapter_runs_off_the_column():
    wide = [line for p in book.chapter_notebooks() for line in book.wide_lines(p)]
    assert wide == [], f"{len(wide)} lines wider than {book.COLUMN} columns, first: {wide[:3]}"


def test_the_column_check_sees_code_and_output_and_skips_what_the_page_hides(tmp_path):
    wide, ok = "x" * (book.COLUMN + 1), "t̃" * book.COLUMN       # a combining tilde takes no column
    cell = lambda source, outputs=(), tags=(): {"cell_type": "code", "source": source, "outputs": list(outputs),
                                               "metadata": {"tags": list(tags)}}
    nb = {"cells": [
        cell(wide), cell(ok, [{"output_type": "stream", "name": "stdout", "text": [ok + "\n", wide]}]),
        cell(wide, tags=["hide-input"]), cell(wide, tags=["remove-input"]), cell(wide, tags=["remove-cell"]),
        cell("", [{"output_type": "stream", "name": "stdout", "text": wide}], tags=["remove-output"]),
        cell("", [{"output_type": "stream", "name": "stderr", "text": wide}], tags=["remove-stderr"]),
        cell("", [{"output_type": "display_data", "data": {"text/plain": wide, "text/html": "<p/>"}}]),
        cell("", [{"output_type": "execute_result", "data": {"text/plain": wide}}]),
        {"cell_type": "markdown", "source": wide, "metadata": {}},
    ]}
    (tmp_path / "c.ipynb").write_text(json.dumps(nb))
    found = [line.split(" (")[0] for line in book.wide_lines(tmp_path / "c.ipynb")]
    assert found == ["c.ipynb cell 0 code", "c.ipynb cell 1 output", "c.ipynb cell 2 code",
                     "c.ipynb cell 8 output"]


def test_printed_lines_wrap_to_the_column_in_a_kernel(monkeypatch):
    import io

    out = io.StringIO()
    stream = book._FitColumn(out, 20)
    print("alpha beta gamma delta epsilon", file=stream)
    print("  " + "z" * 30, "tail", file=stream, end="")
    stream.flush()
    lines = out.getvalue().splitlines()
    assert lines == ["alpha beta gamma", "    delta epsilon", "  zzzzzzzzzzzzzzzzzz", "      zzzzzzzzzzzz",
                     "      tail"]
    assert book.fit_column() is False           # no kernel under pytest: stdout left alone


def test_a_page_table_is_html_with_the_verdict_first_and_text_elsewhere():
    from gradtie.book import pages

    t = pages.Table(("verdict", "node", "err"), (("tied", "a", "1.0e-12"), ("FAILED", "b<c", "3.0e+02")),
                    right=frozenset({2}))
    text = str(t).splitlines()
    assert text[0].startswith("verdict") and text[2] == "tied     a     1.0e-12"
    html = t._repr_html_()
    assert '<td class="gt-red">FAILED</td>' in html and "b&lt;c" in html and html.index("verdict") < html.index("node")
    with pytest.raises(ValueError, match="row 0 has 2 cells"):
        pages.Table(("a", "b", "c"), (("1", "2"),))


def test_every_beyond_the_suite_box_has_the_one_orange_style():
    found = []
    for path in sorted(book.NOTEBOOKS.glob("*.py")):
        lines = path.read_text().splitlines()
        found += [f"{path.name}:{i + 1}" for i, line in enumerate(lines)
                  if line.strip() == "# ```{admonition} Beyond the suite" and lines[i + 1] != "# :class: attention"]
    assert found == []


def test_every_link_to_a_section_names_a_heading_of_its_chapter():
    from myst_parser.mdit_to_docutils.base import default_slugify

    headings = {p.stem: {default_slugify(re.sub(r"^# #+ ", "", line).replace("`", "").strip())
                         for line in p.read_text().splitlines() if re.match(r"# #{2,3} ", line)}
                for p in book.NOTEBOOKS.glob("*.py")}
    missing = []
    for page in [*book.NOTEBOOKS.glob("*.py"), book.BOOK / "intro.md"]:
        for doc, anchor in re.findall(r"\]\(([a-z0-9_]*)(?:\.ipynb)?#([^)\s]+)\)", page.read_text()):
            if anchor not in headings.get(doc or page.stem, set()):
                missing.append(f"{page.name}: {doc or page.stem}#{anchor}")
    assert missing == []


def _fold_harness():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fold_harness", book.ROOT / "tools" / "fold_harness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_cell_that_only_asserts_prints_or_glues_is_folded():
    fold = _fold_harness()
    open_ = [f"{p.name}:{i + 1} ({why})" for p in sorted(book.NOTEBOOKS.glob("*.py"))
             for i, hdr, why, _ in fold.classify(p)[1] if "-input" not in hdr]
    assert open_ == [], "run tools/fold_harness.py --apply on these chapter sources"


def test_the_fold_rule_folds_harness_and_leaves_a_computation_open(tmp_path):
    fold = _fold_harness()
    src = tmp_path / "c.py"
    src.write_text('# %%\nimport jax\n\n# %% tags=["parameters"]\nn: int = 1\n\n# %%\nx = f(n)\n\n'
                   '# %%\nprint(x)\nassert x > 0\n\n# %% tags=["nbval-check-output"]\ny = g(x)\nprint(book.glue("k", y))\n\n'
                   '# %%\nplots.p(x)\nplt.show()\n')
    assert [(why, hdr) for _, hdr, why, _ in fold.classify(src)[1]] == [
        ("setup", "# %%"), ("harness", "# %%"), ("mostly harness", '# %% tags=["nbval-check-output"]')]
    fold.tag(src, apply=True)
    assert src.read_text().count('"hide-input"') == 3 and fold.tag(src) == []


@pytest.mark.parametrize("chapter", [c.name for c in book.CHAPTERS])
def test_every_executed_chapter_runs_its_reviewed_source(chapter):
    assert book.source_drift(book.NOTEBOOKS / f"{chapter}.py", book.NOTEBOOKS / f"{chapter}.ipynb") == []


def test_a_drifted_cell_a_retagged_cell_and_a_lost_cell_are_named(tmp_path):
    src = book.NOTEBOOKS / "head_fold.py"
    nb = json.loads((book.NOTEBOOKS / "head_fold.ipynb").read_text())
    code = next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code")
    nb["cells"][code]["source"] = ["x = 1  # edited after execution\n"]
    nb["cells"][code]["metadata"]["tags"] = ["remove-input"]
    drifted = tmp_path / "head_fold.ipynb"
    drifted.write_text(json.dumps(nb))
    assert book.source_drift(src, drifted) == [f"head_fold.ipynb cell {code}: source, tags differ from head_fold.py"]
    del nb["cells"][-1]
    drifted.write_text(json.dumps(nb))
    assert "cells against" in book.source_drift(src, drifted)[0]
