"""How long each executed chapter renders (`gradtie.book.pagelength`: screens of a 1400×900 window) and
how far down its first figure ends. A chapter is held to about 12 screens and its headline figure to
its first three; the chapters still longer are listed with their measured length, so that one that
grows fails and one that is fixed must leave the list. The proxy is checked against the pages
measured in a browser, and shown to count what the page shows and skip what it hides."""

import json
import subprocess

import pytest

from gradtie import book
from gradtie.book import pagelength

MAX_SCREENS = 12.5          # "about 12 screens"
FIRST_FIGURE_SCREENS = 3.0  # the headline figure's bottom edge within the first three screens

# Chapters still longer than MAX_SCREENS (or with their first figure further down), as measured
# now: (screens, first figure). Each is held to what it measures plus half a screen.
LONG: dict = {}


def _measure(name):
    return pagelength.measure(book.NOTEBOOKS / f"{name}.ipynb")


@pytest.mark.parametrize("chapter", [c.name for c in book.CHAPTERS])
def test_a_chapter_is_about_twelve_screens_with_its_figure_in_the_first_three(chapter):
    m = _measure(chapter)
    assert m.first_figure is not None, f"{chapter}: no figure"
    if chapter not in LONG:
        assert m.screens <= MAX_SCREENS, f"{chapter}: {m.screens:.1f} screens"
        assert m.first_figure <= FIRST_FIGURE_SCREENS, f"{chapter}: first figure ends {m.first_figure:.1f} down"
        return
    screens, first = LONG[chapter]
    assert m.screens <= screens + 0.5 and m.first_figure <= first + 0.5, (chapter, m)
    assert m.screens > MAX_SCREENS or m.first_figure > FIRST_FIGURE_SCREENS, \
        f"{chapter} now fits ({m.screens:.1f} screens, figure at {m.first_figure:.1f}): take it off LONG"


def _at(commit, name):
    try:
        out = subprocess.run(["git", "show", f"{commit}:notebooks/{name}.ipynb"], cwd=book.ROOT,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return json.loads(out.stdout) if out.returncode == 0 else None


@pytest.mark.parametrize("chapter, screens", sorted(pagelength.MEASURED.items()))
def test_the_proxy_reads_the_pages_measured_in_a_browser(chapter, screens):
    nb = _at(pagelength.MEASURED_AT, chapter)
    if nb is None:
        pytest.skip(f"commit {pagelength.MEASURED_AT} is not in this clone's history")
    m = pagelength.measure(nb)
    assert abs(m.screens - screens) <= 0.06 * screens, (chapter, m.screens, screens)
    if chapter == "whole_net_tie":       # its first figure was 14 screens down (its top edge)
        assert 14 <= m.first_figure <= 17


def _cell(source="", outputs=(), tags=(), kind="code"):
    return {"cell_type": kind, "source": source, "outputs": list(outputs), "metadata": {"tags": list(tags)}}


def _png(width, height):
    import base64
    import struct
    import zlib

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    raw = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\x00" * (width + 1) * height)) + chunk(b"IEND", b""))
    return {"output_type": "display_data", "data": {"image/png": base64.b64encode(raw).decode(), "text/plain": "<F>"}}


def test_the_proxy_counts_what_the_page_shows_and_skips_what_it_hides():
    code = "\n".join(f"x{i} = {i}" for i in range(40))
    out = {"output_type": "stream", "name": "stdout", "text": "line\n" * 40}
    shown = pagelength.measure({"cells": [_cell(code, [out])]})
    assert shown.px == pytest.approx(pagelength.SCALE * 2 * (40 * pagelength.CODE_LINE_PX + pagelength.BLOCK_PX))
    folded = pagelength.measure({"cells": [_cell(code, [out], ["hide-input"])]})
    assert folded.px < shown.px and folded.px > pagelength.measure({"cells": [_cell(code, [out], ["remove-input"])]}).px
    assert pagelength.measure({"cells": [_cell(code, [out], ["remove-cell"])]}).px == 0
    assert pagelength.measure({"cells": [_cell("", [out], ["hide-output"])]}).px == pytest.approx(
        pagelength.SCALE * pagelength.TOGGLE_PX)
    # a table folded under its summary line (pages.folded) is that line until opened
    from gradtie.book import pages
    table = pages.Table(("verdict", "site"), tuple(("ok", f"s{i}") for i in range(20)))
    as_html = lambda t: {"output_type": "display_data", "data": {"text/html": t._repr_html_(),  # noqa: E731
                                                                 "text/plain": str(t)}}
    open_rows = pagelength.measure({"cells": [_cell("", [as_html(table)], ["hide-input"])]}).px
    closed = pagelength.measure({"cells": [_cell("", [as_html(pages.folded(table, "20 sites"))], ["hide-input"])]}).px
    assert closed == pytest.approx(pagelength.SCALE * 2 * pagelength.TOGGLE_PX) and closed < open_rows
    glued = {"output_type": "display_data", "data": {"application/papermill.record/text/plain": "'x'"}}
    assert pagelength.measure({"cells": [_cell("", [glued])]}).px == 0
    # an admonition shown folded (sphinx-togglebutton's dropdown class) is its title bar until opened
    body = "\n".join(["word " * 18] * 20)
    boxed = lambda cls: f"```{{admonition}} Details\n:class: {cls}\n{body}\n```\n\nafter"
    assert pagelength.markdown_px(boxed("dropdown")) == pagelength.ADMONITION_PX + pagelength.markdown_px("after")
    assert pagelength.markdown_px(boxed("attention")) > 20 * pagelength.PROSE_LINE_PX
    nested = "```{admonition} Code\n:class: dropdown\n```python\nx = 1\n```\n```\n\nafter"
    assert pagelength.markdown_px(nested) == pagelength.ADMONITION_PX + pagelength.markdown_px("after")
    # prose wraps at the column: a paragraph twice as long is twice as many lines
    one, two = ("word " * 19, "word " * 38)
    assert (pagelength.markdown_px(two) - pagelength.PARAGRAPH_PX
            == 2 * (pagelength.markdown_px(one) - pagelength.PARAGRAPH_PX))


def test_a_figure_is_scaled_to_the_column_and_its_position_found():
    wide, narrow = _png(1568, 800), _png(700, 400)
    assert pagelength.figure_px(wide["data"]["image/png"]) == pytest.approx(400)
    assert pagelength.figure_px(narrow["data"]["image/png"]) == pytest.approx(400)
    prose = _cell("\n".join(["word " * 18] * 100), kind="markdown")
    early = pagelength.measure({"cells": [_cell("plot()", [narrow]), prose]})
    late = pagelength.measure({"cells": [prose, _cell("plot()", [narrow])]})
    assert early.first_figure < 1 < FIRST_FIGURE_SCREENS < late.first_figure
    assert early.screens == pytest.approx(late.screens)
    assert pagelength.measure({"cells": [prose]}).first_figure is None
    with pytest.raises(ValueError, match="not a PNG"):
        pagelength.figure_px("aGVsbG8=")
