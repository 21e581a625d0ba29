"""How long an executed chapter's rendered page is, in screens of a 1400×900 browser window, and how
far down its first figure ends: a proxy read from the notebook, without a browser.

The page is a stack of blocks whose heights the theme fixes (sphinx-book-theme, Jupyter Book 1.x,
at a 1400 px window: a 784 px content column, 16 px body text, 14 px monospace). Each block is
measured in pixels:

- prose: a paragraph wraps at `PROSE_CHARS` characters to a line of `PROSE_LINE_PX`; each
  paragraph, list item, heading and admonition adds its margin; an admonition shown folded
  (`:class: dropdown`, sphinx-togglebutton) is its title bar, `ADMONITION_PX`, until opened;
- code a reader sees: `CODE_LINE_PX` a line and `BLOCK_PX` of padding; an input folded with
  `hide-input` (or an output with `hide-output`) is its toggle bar, `TOGGLE_PX`; `remove-input`,
  `remove-output` and `remove-cell` take nothing, nor do glued records (stored, not shown);
- a figure: its PNG height (drawn at 100 dpi, shown at its pixel size, scaled down to the column
  when wider); an HTML table: `TABLE_ROW_PX` a row; one folded in a closed `<details>`
  (`pages.folded`) is its summary bar, `TOGGLE_PX`.

The constants are the theme's sizes, not fitted; one factor, `SCALE`, is: the rendered pages were
measured in a browser at commit 6a25005 (Whole-net tie 32 screens with its first figure 14 screens
down, Pools 25, bf16 erasure 22), where the unscaled sum reads 30.8, 22.1 and 20.7 screens, and
`SCALE` is their mean ratio (`tests/test_pagelength.py` holds the proxy to those measurements when
the history is at hand).
"""

from __future__ import annotations

import base64
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

SCREEN_PX = 900        # the window's height
COLUMN_PX = 784        # the content column at a 1400 px window
PROSE_CHARS = 95       # characters of 16 px body text a 784 px line holds
PROSE_LINE_PX = 26     # 16 px × line-height 1.65
PARAGRAPH_PX = 16      # the margin after a paragraph or list
HEADING_PX = {1: 80, 2: 60, 3: 48, 4: 40}
ADMONITION_PX = 70     # an admonition's title bar and padding
CODE_LINE_PX = 20      # 14 px monospace × line-height 1.4
BLOCK_PX = 30          # a code input's or output's padding and margin
TOGGLE_PX = 44         # a folded input or output: its "Show code cell …" bar
TABLE_ROW_PX = 33      # a row of an HTML or Markdown table
FIGURE_MARGIN_PX = 20
# The rendered pages measured in a browser at commit 6a25005 (`MEASURED`) read 3–13 % longer than
# the sum of the blocks above (margins between cells, scroll bars under wide blocks): the mean
# ratio, 1.08, scales the sum. Residuals after it: within 5 %.
SCALE = 1.08
MEASURED_AT = "6a25005"
MEASURED = {"whole_net_tie": 32.0, "pools": 25.0, "bf16_erasure": 22.0}   # screens, in a browser

HIDDEN_PREFIX = "application/papermill.record/"   # a glued record: stored for other pages, not shown


@dataclass(frozen=True)
class PageLength:
    """screens: the whole page's height in window heights; first_figure: how many window heights
    down the first figure's bottom edge lies (None: no figure)."""
    screens: float
    first_figure: Optional[float]
    px: float


def _png_size(data: str) -> tuple[int, int]:
    raw = base64.b64decode(data if isinstance(data, str) else "".join(data))
    if raw[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("pagelength: an image/png output that is not a PNG")
    width, height = struct.unpack(">II", raw[16:24])
    return width, height


def figure_px(data: str) -> float:
    """A PNG output's shown height: its pixel height, scaled down when wider than the column."""
    width, height = _png_size(data)
    return height * min(1.0, COLUMN_PX / width)


def _paragraph_px(text: str) -> float:
    return max(1, math.ceil(len(" ".join(text.split())) / PROSE_CHARS)) * PROSE_LINE_PX


def markdown_px(source: str) -> float:
    """A markdown cell's rendered height: headings, paragraphs, list items, tables, admonitions."""
    px = 0.0
    para: list[str] = []
    fence: Optional[str] = None       # None, "box" (an admonition: its body is prose) or "code"

    def flush():
        nonlocal px, para
        if para:
            px += _paragraph_px(" ".join(para)) + PARAGRAPH_PX
            para = []

    folded = 0            # inside a folded box (`:class: dropdown`): 1 + the fences nested in it
    for line in source.splitlines():
        s = line.strip()
        if folded:
            if s == "```":
                folded -= 1
                fence = None if folded == 0 else fence
            elif s.startswith("```"):
                folded += 1
            continue
        if s.startswith("```"):
            flush()
            if fence is None:
                fence = "box" if s.startswith("```{") and "{code" not in s else "code"
                px += ADMONITION_PX if fence == "box" else BLOCK_PX
            elif s == "```":
                fence = None
            continue
        if fence == "code":
            px += CODE_LINE_PX
            continue
        if fence == "box" and re.fullmatch(r":[\w-]+:.*", s):
            if re.fullmatch(r":class:.*\bdropdown\b.*", s):
                folded = 1                        # shown folded: its title bar only
            continue                              # a directive option (:class: attention)
        heading = re.match(r"(#{1,6}) ", s)
        if heading:
            flush()
            px += HEADING_PX.get(len(heading.group(1)), 40)
        elif not s:
            flush()
        elif s.startswith("|"):
            flush()
            if not re.fullmatch(r"\|[-:| ]+\|", s):
                px += TABLE_ROW_PX
        elif re.match(r"([-*+]|\d+\.) ", s):
            flush()
            para = [s]
        else:
            para.append(s)
    flush()
    return px


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "".join(value)


def _lines_px(text: str) -> float:
    n = len(text.rstrip("\n").splitlines())
    return n * CODE_LINE_PX + BLOCK_PX if n else 0.0


def output_px(out: dict) -> tuple[float, bool]:
    """(shown height, whether it is a figure) of one output."""
    kind = out.get("output_type")
    if kind == "stream":
        return _lines_px(_text(out.get("text", ""))), False
    if kind == "error":
        return _lines_px("\n".join(out.get("traceback", []))), False
    data = out.get("data", {})
    if not data or all(k.startswith(HIDDEN_PREFIX) for k in data):
        return 0.0, False
    if "image/png" in data:
        return figure_px(data["image/png"]) + FIGURE_MARGIN_PX, True
    if "text/html" in data:
        html = _text(data["text/html"])
        if re.match(r"\s*<details(?![^>]*\bopen\b)", html):   # folded (`pages.folded`): its summary bar
            return TOGGLE_PX, False
        rows = len(re.findall(r"<tr[\s>]", html))
        return (rows * TABLE_ROW_PX + BLOCK_PX if rows else _lines_px(re.sub(r"<[^>]+>", "", html))), False
    if "text/markdown" in data:
        return markdown_px(_text(data["text/markdown"])), False
    if "text/plain" in data:
        return _lines_px(_text(data["text/plain"])), False
    return 0.0, False


def measure(nb: Union[dict, Path, str]) -> PageLength:
    """The rendered height of an executed notebook (its JSON as a dict, or a path), in screens,
    and the screen its first figure ends on."""
    if not isinstance(nb, dict):
        nb = json.loads(Path(nb).read_text())
    px, first = 0.0, None
    for cell in nb["cells"]:
        tags = set(cell.get("metadata", {}).get("tags", []))
        source = _text(cell.get("source", ""))
        if "remove-cell" in tags:
            continue
        if cell["cell_type"] == "markdown":
            px += markdown_px(source)
            continue
        if cell["cell_type"] != "code":
            continue
        if "hide-input" in tags:
            px += TOGGLE_PX
        elif "remove-input" not in tags and source.strip():
            px += len(source.splitlines()) * CODE_LINE_PX + BLOCK_PX
        if "remove-output" in tags:
            continue
        shown = [output_px(o) for o in cell.get("outputs", [])
                 if not (o.get("output_type") == "stream" and o.get("name") == "stderr" and "remove-stderr" in tags)]
        if "hide-output" in tags and any(h for h, _ in shown):
            px += TOGGLE_PX
            continue
        for height, is_figure in shown:
            px += height
            if is_figure and first is None:
                first = px / SCREEN_PX
    return PageLength(SCALE * px / SCREEN_PX, None if first is None else SCALE * first, SCALE * px)
