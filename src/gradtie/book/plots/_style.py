"""Figure conventions every chapter's figures share: size, the colour of a tie and of a control, the
smallest font, and legends that sit outside the data.

The book's content column is about 784 px wide and a notebook figure is drawn at 100 dpi, so a
figure up to `MAX_WIDTH` inches is shown at full size; a wider one is shrunk, and its text with it.
`MIN_FONT` points at 100 dpi is the body's footnote size: no text of a figure is smaller.
"""

from __future__ import annotations

import math

OK_COLOR = "tab:blue"
CONTROL_COLOR = "tab:red"
FIGSIZE = (7.0, 4.0)
MAX_WIDTH = 7.8     # inches: the content column at 100 dpi
MIN_FONT = 9        # points


def legend_below(fig, axes=None, *, ncol: int = 2, handles=None, labels=None):
    """One legend for the figure, centred under its axes, never over the data; the layout leaves it
    room. Entries come from `axes` (all of the figure's, by default), each label once."""
    if handles is None:
        seen = {}
        for ax in (axes if axes is not None else fig.axes):
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if not lab.startswith("_"):
                    seen.setdefault(lab, h)
        labels, handles = list(seen), list(seen.values())
    if not handles:
        fig.tight_layout()
        return None
    rows = math.ceil(len(handles) / ncol)
    room = (0.24 * rows + 0.1) / fig.get_figheight()
    fig.tight_layout(rect=(0, room, 1, 1))
    return fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=MIN_FONT, frameon=False,
                      bbox_to_anchor=(0.5, 0.0))


def problems(fig) -> list[str]:
    """What breaks the conventions in a drawn figure: wider than the column, text smaller than
    `MIN_FONT`, a legend overlapping an axes' data area, a bar running past its axes."""
    import matplotlib.text

    found = []
    if fig.get_figwidth() > MAX_WIDTH + 1e-9:
        found.append(f"{fig.get_figwidth():.1f} in wide (the column holds {MAX_WIDTH})")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    small = {t.get_text() for t in fig.findobj(matplotlib.text.Text)
             if t.get_visible() and t.get_text().strip() and t.get_fontsize() < MIN_FONT - 1e-9}
    found += [f"text {s!r} under {MIN_FONT} pt" for s in sorted(small)]
    legends = [lg for lg in [fig.legends, *[[ax.get_legend()] for ax in fig.axes]] for lg in lg if lg]
    for lg in legends:
        box = lg.get_window_extent(renderer)
        for ax in fig.axes:
            if ax.axison and box.overlaps(ax.get_window_extent(renderer)):
                found.append(f"a legend over the data of {ax.get_title() or 'an axes'!r}")
    for ax in fig.axes:
        lo, hi = sorted(ax.get_xlim())
        for patch in ax.patches:
            x1 = patch.get_x() + patch.get_width() if hasattr(patch, "get_width") else None
            if x1 is not None and patch.get_width() > 0 and x1 > hi * (1 + 1e-9):
                found.append(f"a bar clipped at the right edge of {ax.get_title() or 'an axes'!r}")
                break
    return found
