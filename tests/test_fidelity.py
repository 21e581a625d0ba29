"""The book says what the suite states and no more: the node ties (`r34_net_tiedB`,
`r34_net_syncTiedB`) carry no smoothness clause anywhere the book names them, nothing cites "SPEC"
(not part of the repository: the book cites the Lean statement or the chapter), and every figure the
claim map files beyond the suite is glued in a cell the chapter marks as beyond the suite.

"Marked as beyond the suite" (`claims.marked_beyond`): the nearest markdown cell above the code cell
that glues the figure carries `claims.BEYOND_MARKER`, a MyST admonition titled "Beyond the suite".
"""

import re

from gradtie import book
from gradtie.book import claims
from gradtie.checks import census

NODE_TIES = ("r34_net_tiedB", "r34_net_syncTiedB")
# words that give a statement a smoothness hypothesis, and phrases that deny it one
SMOOTHNESS = re.compile(r"SmoothAt|smooth point|off 0|off its kink|kink|dead, strict|twin|ReLU input")
DENIED = re.compile(r"no smoothness clause|no hypothesis|carry none|carry no|carries no|needs none")


def _sentences(text: str):
    """Sentences of a source or page, comment markers dropped; a table row or bullet is its own chunk."""
    text = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in text.splitlines())
    for chunk in re.split(r"\n\s*\n|\n\s*[-|]\s|\n\|", text):
        yield from re.split(r"(?<=[.;])\s+(?=[A-Z(`*])", " ".join(chunk.split()))


def smoothness_given(text: str) -> list[str]:
    """Sentences that name a node tie next to a smoothness clause and do not deny it one."""
    return [s for s in _sentences(text)
            if any(n in s for n in NODE_TIES) and SMOOTHNESS.search(s) and not DENIED.search(s)]


def test_the_claim_map_gives_the_node_ties_no_smoothness_clause():
    rows = {c.name: c for c in claims.SUITE}
    for name in NODE_TIES:
        assert "no smoothness clause" in rows[name].hypotheses
        assert not SMOOTHNESS.search(rows[name].hypotheses), rows[name].hypotheses
    assert "`hR : 0 < R`, `hN : 0 < N`" in rows["r34_net_syncTiedB"].hypotheses
    assert "N a binder" in rows["r34_net_tiedB"].hypotheses
    # the binders as the statements have them (ResNet34StepTieB.lean, ResNet34SyncStepTieB)
    assert rows["r34_net_tiedB"].binders == ("N", "nCls", "α", "B", "w", "x", "t")
    assert rows["r34_net_syncTiedB"].binders[:2] == ("R", "N")


def test_no_chapter_page_or_census_gives_the_node_ties_a_smoothness_clause():
    src = book.ROOT / "src" / "gradtie"
    paths = [*sorted(book.NOTEBOOKS.glob("*.py")), book.BOOK / "intro.md", src / "checks" / "census.py",
             src / "book" / "claims.py"]
    found = [f"{p.name}: {s[:160]}" for p in paths for s in smoothness_given(p.read_text())]
    assert found == []


def test_a_smoothness_clause_given_to_a_node_tie_is_found():
    # the sentences the book carried before: a table row, a bullet and a prose sentence
    assert smoothness_given("# | parameter gradients: `Cifar8BbnLossSmoothAt` | `cifar8Bbn_net_lossGrad`, and "
                            "ResNet-34's `r34_net_tiedB` | allowed | allowed | fails |\n")
    assert smoothness_given("# - `r34_net_tiedB`: ResNet-34's 110 gradient nodes (hypothesis: every ReLU input\n"
                            "#   off 0, every pool window dead, strict or a twin tie);\n")
    assert smoothness_given("#   - Its hypotheses are those of `r34_net_syncTiedB` at the global batch: a\n"
                            "#     smooth point (no ReLU input exactly 0).\n")
    assert not smoothness_given("# `r34_net_tiedB` carries no smoothness clause: it holds at every kink.\n")


def test_the_census_files_resnet34s_parameter_hypothesis_under_the_whole_loss_statement():
    report = census.SmoothReport(pools=[], zeros=0, min_abs_preactivation=1.0, net="resnet34", suite="resnet34")
    assert report.hypothesis(census.PARAMETERS).lean == "r34_net_lossGrad"


def _spec_citations(paths) -> list[str]:
    return [f"{p.relative_to(book.ROOT)}:{i}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bSPEC\b", line)]


def test_nothing_in_the_book_the_package_or_the_tests_cites_spec():
    paths = [*sorted(book.NOTEBOOKS.glob("*.py")), book.BOOK / "intro.md",
             *sorted((book.ROOT / "src" / "gradtie").rglob("*.py")),
             *(p for p in sorted((book.ROOT / "tests").rglob("*.py")) if p.name != "test_fidelity.py")]
    assert _spec_citations(paths) == []


def test_a_spec_citation_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(book, "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("fine\nfloored at SPEC's 1e-10\nSPECS and PoolSpec are names, not citations\n")
    assert _spec_citations([page]) == ["page.md:2"]


def test_every_figure_beyond_the_suite_is_glued_in_a_cell_marked_beyond():
    assert claims.unmarked_beyond() == []
    assert claims.problems() == []


def test_the_intro_links_the_upstream_suite():
    assert "https://github.com/brettkoonce/lean4-mlir" in (book.BOOK / "intro.md").read_text()


def test_an_unmarked_beyond_figure_is_found(tmp_path):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    source = (book.NOTEBOOKS / "head_fold.py").read_text()
    assert claims.BEYOND_MARKER in source
    (folder / "head_fold.py").write_text(source.replace(claims.BEYOND_MARKER, "```{note} Beyond the suite"))
    minimum = [c for c in claims.BEYOND if c.name == "the smoothed loss's minimum"]
    found = "\n".join(claims.unmarked_beyond(minimum, folder))
    assert "glues 'smoothed_minimum' in a cell not marked beyond the suite" in found
    assert "heading '## Where the smoothed loss bottoms out (beyond the suite)' carries no" in found


def test_marked_beyond_reads_the_nearest_markdown_cell():
    source = ("# %% [markdown]\n# " + claims.BEYOND_MARKER + "\n# ```\n\n# %%\nx = 1\n\n"
              "# %% tags=[\"nbval-check-output\"]\nprint(book.glue(\"a\", x))\n\n"
              "# %% [markdown]\n# plain\n\n# %% tags=[\"nbval-check-output\"]\nprint(book.glue(\"b\", x))\n")
    assert claims.marked_beyond(source, "a") is True
    assert claims.marked_beyond(source, "b") is False
    assert claims.marked_beyond(source, "c") is None
