"""Claims as data: every glued figure records the point it was computed at (`book.At`), and the claim
map holds each suite row's figures to its statement's literal sizes and hypotheses
(`claims.point_problems`), its prose to its binders and hypotheses (`claims.prose_problems`), and the
intro's counts to the map (`claims.render_counts`). Each check is shown failing on a planted mismatch.
Reads the executed chapters and the sources only: nothing is computed."""

import ast
import json
import re

import pytest

from gradtie import book
from gradtie.book import claims

PREFIX = "application/papermill.record/"


def _glue_calls(path):
    tree = ast.parse(path.read_text())
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "glue" and isinstance(node.func.value, ast.Name) and node.func.value.id == "book"]


def test_every_glued_figure_records_its_point():
    missing = [f"{p.name}:{call.lineno} {ast.unparse(call.args[0])}" for p in sorted(book.NOTEBOOKS.glob("*.py"))
               for call in _glue_calls(p) if not any(k.arg == "at" for k in call.keywords)]
    assert missing == []


def test_every_suite_figure_lies_at_its_statements_literals_and_inside_its_hypotheses():
    assert claims.point_problems() == []


def test_every_cited_suite_figure_carries_the_points_the_map_reads():
    """The executed chapters hold a point for every figure a suite row cites, at the row's net."""
    for claim in claims.SUITE:
        for s in claim.shown:
            glued = claims.figures(s.chapter)
            for key in s.figures:
                text, points = glued[key]
                assert text and points, (claim.name, key)
                assert claim.net is None or any(p.net == claim.net for p in points), (claim.name, key)


# ---- planted mismatches: a notebook of glued figures written by hand -----------------------------

def _notebook(folder, chapter, figures):
    """notebooks/<chapter>.ipynb holding `figures` {key: (text, [At, …] or None)} as myst-nb glues them."""
    outputs = []
    for key, (text, points) in figures.items():
        data = {PREFIX + "text/plain": repr(text)}
        if points is not None:
            data[PREFIX + book.POINT_MIME] = json.dumps({"text": text, "at": [p.as_dict() for p in points]})
        outputs.append({"output_type": "display_data", "data": data,
                        "metadata": {"scrapbook": {"name": key, "mime_prefix": PREFIX}}})
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": "", "outputs": outputs, "execution_count": 1}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (folder / f"{chapter}.ipynb").write_text(json.dumps(nb))
    return folder


R34 = dict(net="resnet34", classes=10, alpha=0.1, dtype="float64", weights="drawn", extra={"widths": [64, 128, 256, 512]})
ROW = next(c for c in claims.SUITE if c.name == "r34_net_lossGrad")


def _claim(*, beyond_literal=False, claim=ROW):
    return claims.Claim(claim.name, claim.statement, claim.hypotheses,
                        (claims.Shown("whole_net_tie", "s", ("fig",), beyond_literal),), net=claim.net,
                        literals=claim.literals, binders=claim.binders, census=claim.census)


def test_a_32px_figure_cited_unlabelled_by_a_224px_statement_fails(tmp_path):
    at32 = book.At(**R34, image_size=32, batch=4, data="photos", census={"parameters": True})
    at224 = book.At(**R34, image_size=224, batch=2, data="randn", census={"parameters": True})
    _notebook(tmp_path, "whole_net_tie", {"fig": ("4/4 tied", [at32])})
    found = "\n".join(claims.point_problems([_claim()], tmp_path))
    assert "image_size 32 (the statement's literal: 224)" in found and claims.BEYOND_LITERAL in found
    assert claims.point_problems([_claim(beyond_literal=True)], tmp_path) == []     # labelled: allowed
    _notebook(tmp_path, "whole_net_tie", {"fig": ("2/2 tied", [at224])})
    assert claims.point_problems([_claim()], tmp_path) == []
    found = "\n".join(claims.point_problems([_claim(beyond_literal=True)], tmp_path))
    assert "labelled" in found and "every point lies at the statement's literals" in found   # a false label


def test_the_real_chapter_figure_cited_unlabelled_fails():
    """The same mismatch planted in the map against the executed chapter: the 32-px stage ties cited
    by `r34_net_tiedB` without their label."""
    row = next(c for c in claims.SUITE if c.name == "r34_net_tiedB")
    planted = claims.Claim(row.name, row.statement, row.hypotheses,
                           (claims.Shown("stage_by_stage", "ResNet-34's eighteen stages", ("r34_stage_ties",)),),
                           net=row.net, literals=row.literals, binders=row.binders)
    found = "\n".join(claims.point_problems([planted]))
    assert "r34_stage_ties" in found and "(the statement's literal: 224)" in found


def test_a_figure_where_the_census_says_the_hypothesis_fails_is_found(tmp_path):
    fails = book.At(**R34, image_size=224, batch=2, data="flat", census={"parameters": False})
    _notebook(tmp_path, "whole_net_tie", {"fig": ("2/2 tied", [fails])})
    found = "\n".join(claims.point_problems([_claim()], tmp_path))
    assert "census says 'parameters' fails" in found
    # a control may run there (a planted bug, a refusal): it is no evidence for the statement
    _notebook(tmp_path, "whole_net_tie", {"fig": ("red", [book.At(**{**fails.as_dict(), "role": "control"})])})
    assert claims.point_problems([_claim()], tmp_path) == []
    # a census not taken is not a census that holds
    _notebook(tmp_path, "whole_net_tie", {"fig": ("2/2", [book.At(**R34, image_size=224, batch=2, data="randn")])})
    assert "records no census of 'parameters'" in "\n".join(claims.point_problems([_claim()], tmp_path))


def test_a_figure_without_a_point_or_at_another_net_is_found(tmp_path):
    _notebook(tmp_path, "whole_net_tie", {"fig": ("2/2 tied", None)})
    assert "records no point" in "\n".join(claims.point_problems([_claim()], tmp_path))
    _notebook(tmp_path, "whole_net_tie", {"fig": ("38/38", [book.At("cifar8", image_size=32, census={"parameters": True})])})
    assert "computed at no point of resnet34" in "\n".join(claims.point_problems([_claim()], tmp_path))
    _notebook(tmp_path, "whole_net_tie", {})
    assert "glued no 'fig'" in "\n".join(claims.point_problems([_claim()], tmp_path))


def test_an_alpha_literal_is_held_too(tmp_path):
    ce = next(c for c in claims.SUITE if c.name == "cifar8Bbn_net_lossGrad_CE")
    point = dict(net="cifar8", image_size=32, batch=4, data="photos", census={"parameters": True})
    _notebook(tmp_path, "whole_net_tie", {"fig": ("38/38", [book.At(**point, alpha=0.1)])})
    assert "alpha 0.1 (the statement's literal: 0.0)" in "\n".join(claims.point_problems([_claim(claim=ce)], tmp_path))
    _notebook(tmp_path, "whole_net_tie", {"fig": ("38/38", [book.At(**point, alpha=0.0)])})
    assert claims.point_problems([_claim(claim=ce)], tmp_path) == []


# ---- the rows as data ---------------------------------------------------------------------------

def test_every_suite_row_declares_its_literals_binders_and_source():
    for c in claims.SUITE:
        assert c.source, c.name
        assert c.binders or not c.source.startswith(claims.UPSTREAM), c.name      # read from the statement itself
        assert all(k in claims.CENSUS_KEYS for k in c.census), c.name
        if c.net == "resnet34" and c.literals:
            assert dict(c.literals) == dict(claims.R34_LITERALS) | {k: v for k, v in c.literals if k != "image_size"}
    rows = {c.name: c for c in claims.SUITE}
    assert dict(rows["r34_net_tiedB"].literals)["image_size"] == 224
    assert rows["r34IdCotIn_eq_vjp"].literals == ()              # `(N h w : Nat)`: dimension-generic
    assert rows["r34InputGradB_correct"].census == ("resnet34_input",)
    assert rows["cifar8BbnInputGradB_correct"].census == ("cifar8_input",)
    assert claims.problems() == []


def test_the_rendered_table_labels_every_figure_beyond_the_literal_resolution():
    table = claims.render_table()
    for c in claims.SUITE:
        for s in c.shown:
            for key in s.figures:
                cell = f"{s.chapter}.ipynb::{key}:s`" + (f" ({claims.BEYOND_LITERAL})" if s.beyond_literal else "")
                assert cell in table, (c.name, key)
    assert "binders N, nCls, α, B, w, x, t" in claims.render_hypotheses()


def _heading_slugs(chapter):
    from myst_parser.mdit_to_docutils.base import default_slugify

    lines = (book.NOTEBOOKS / f"{chapter}.py").read_text().splitlines()
    return {default_slugify(re.sub(r"^# #+ ", "", line).replace("`", "").strip())
            for line in lines if re.match(r"# #{2,3} ", line)}


def _section_links(table):
    return re.findall(r"\]\(([a-z0-9_]+)\.ipynb#([^)\s]+)\)", table)


def test_every_section_the_map_links_is_a_heading_anchor_of_its_chapter():
    links = _section_links(claims.render_table())
    assert len(links) == sum(len(c.shown) for c in claims.CLAIMS)
    assert [f"{doc}#{slug}" for doc, slug in links if slug not in _heading_slugs(doc)] == []
    # apostrophes and inline code leave the slug as the heading's anchor has it
    assert ("stage_by_stage", "cifar8s-input-gradient-at-every-n-inside-maxpool2smooth") in links
    # the control: a section the chapter does not have links nowhere
    bad = claims.Claim("x", "x", "none", (claims.Shown("stage_by_stage", "cifar8's eighteen layers"),))
    (doc, slug), = _section_links(claims.render_table([bad]))
    assert slug == "cifar8s-eighteen-layers" and slug not in _heading_slugs(doc)


def test_the_statements_link_their_upstream_files_at_a_pinned_commit():
    table, hyps = claims.render_table(), claims.render_hypotheses()
    urls = set(re.findall(r"\]\((https://github\.com/brettkoonce/lean4-mlir/blob/[^)]+)\)", table + hyps))
    assert urls and all(re.fullmatch(r".*/blob/[0-9a-f]{40}/LeanMlir/Proofs/.+\.lean", u) for u in urls)
    linked = set(re.findall(r"\[`([^`]+)`\]\(https://github", table + hyps))
    suite_names = {c.name for c in claims.SUITE}
    assert {"r34_net_tiedB", "r34InputGradB_correct", "r34_net_syncTiedB", "Bf16Erasure",
            "resnet34ForwardBFull_eq_slots", "r34HeadBHasVJP"} <= linked
    # every name the file map knows is a name the map cites, and a name it does not know stays plain
    cited = " ".join(c.statement + " " + c.hypotheses for c in claims.SUITE)
    assert all(f"`{name}`" in cited or name in suite_names for name in claims.UPSTREAM_FILES)
    assert claims.upstream_url("cifar8Bbn_net_lossGrad") is None
    assert "[`cifar8Bbn_net_lossGrad`]" not in table and "`cifar8Bbn_net_lossGrad`" in table


def test_the_intro_hypotheses_are_the_rendered_ones():
    page = (book.BOOK / "intro.md").read_text()
    assert claims.hypotheses_between_markers(page) == claims.render_hypotheses()


def test_the_intro_counts_are_computed_from_the_map():
    page = (book.BOOK / "intro.md").read_text()
    assert claims.counts_between_markers(page) == claims.render_counts()
    n = claims.counts()
    assert n.statements == len(claims.SUITE) and n.beyond_suite == len(claims.BEYOND)
    assert n.figures == n.exact + n.beyond_literal and n.beyond_literal == sum(
        s.beyond_literal for c in claims.SUITE for s in c.shown for _ in s.figures)
    one_more = claims.render_counts(claims.CLAIMS + (claims.SUITE[0],))
    assert one_more != claims.render_counts() and f"{n.statements + 1} statements" in one_more


# ---- the prose ----------------------------------------------------------------------------------

PROSE = [*sorted(book.NOTEBOOKS.glob("*.py")), book.BOOK / "intro.md", book.ROOT / "README.md"]


def test_the_prose_names_binders_and_hypotheses_as_the_rows_have_them():
    assert claims.prose_problems(PROSE) == []


@pytest.mark.parametrize("sentence, message", [
    ("# ResNet-34's statements fix 224 px (N is their only binder): a figure elsewhere says so.\n", "only binder"),
    ("# `r34_net_tiedB` carries no smoothness clause (N is a binder).\n", "r34_net_tiedB's binders are"),
    ("# The node ties take N and R as binders.\n", "binders of no named statement"),
    ("# `r34_net_lossGrad` holds where `Cifar8BbnSmoothAt` holds.\n", "Cifar8BbnSmoothAt named beside r34_net_lossGrad"),
])
def test_a_sentence_that_disagrees_with_its_row_is_found(tmp_path, sentence, message):
    page = tmp_path / "page.py"
    page.write_text(sentence)
    assert message in "\n".join(claims.prose_problems([page]))


def test_a_sentence_that_agrees_with_its_row_passes(tmp_path):
    page = tmp_path / "page.py"
    page.write_text("# `r34_net_tiedB` carries no smoothness clause (its binders are N, nCls, α, B, w, x, t).\n"
                    "# `r34_net_lossGrad` takes `R34PosB` and `R34LossSmoothAtB`.\n"
                    "# Each row lists its binders.\n")
    assert claims.prose_problems([page]) == []


# ---- book.At and book.glued -----------------------------------------------------------------------

def test_a_point_round_trips_through_json_and_describes_itself():
    p = book.At("resnet34", 224, 2, 10, 0.1, "randn", "float64", "drawn", census={"parameters": True},
                extra={"widths": [64, 128, 256, 512]})
    assert book.At.from_dict(json.loads(json.dumps(p.as_dict()))) == book.At(**{**p.as_dict(), "extra": p.extra})
    assert p.describe() == "resnet34, 224 px, N = 2, K = 10, α = 0.1, randn, float64, drawn"
    assert book.At("cifar8", batch=(1, 2, 4), role="control").describe() == "cifar8, N = 1, 2, 4 (control)"


@pytest.mark.parametrize("kwargs, message", [
    ({"net": ""}, "net must be"), ({"net": "x", "role": "proof"}, "role must be"),
    ({"net": "x", "image_size": "224"}, "image_size must be"), ({"net": "x", "census": {"parameters": 1}}, "census must"),
])
def test_a_bad_point_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        book.At(**kwargs)


def test_glue_refuses_a_point_that_is_not_one():
    with pytest.raises(ValueError, match="at must be an At"):
        book.glue("k", 1, at="resnet34")
    with pytest.raises(ValueError, match="at must be an At"):
        book.glue("k", 1, at=())


def test_glued_reads_text_and_points_back(tmp_path, monkeypatch):
    import IPython
    import myst_nb

    stored = []
    monkeypatch.setattr(IPython, "get_ipython", lambda: object())
    monkeypatch.setattr(myst_nb, "glue", lambda key, obj, display: stored.append((key, obj)))
    at = book.At("cifar8", 32, 4, census={"cifar8_input": False})
    assert book.glue("fig", (3, 4), "{}/{}", at=at) == "3/4"
    key, obj = stored[0]
    bundle = obj._repr_mimebundle_()
    assert bundle["text/plain"] == "'3/4'"               # what {glue:text} pastes: unchanged
    _notebook(tmp_path, "c", {"fig": ("3/4", [at]), "plain": ("5", None)})
    assert book.glued(tmp_path / "c.ipynb") == {"fig": ("3/4", (at,)), "plain": ("5", ())}
    assert json.loads(bundle[book.POINT_MIME])["at"] == [at.as_dict()]
