"""Tables for the book's page: a report's rows as an HTML table, the verdict first, narrow enough
for the content column; the same rows as fixed-width text wherever no HTML is shown.

The checks print their tables as fixed-width text (`TieReport.table`, `bugs.listing`, …): a
terminal scrolls sideways, a book page does not. A chapter shows the same rows with these
functions instead, as the last expression of a cell:

    pages.tie(report.tie)            # one row per node: verdict, node, shape, M, errors and limit

Each returns a `Table`: IPython shows its HTML (`_repr_html_`), `str(table)` is the text, and
nbval compares both where a cell is tagged `nbval-check-output`.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

RED = frozenset({"FAILED", "NO", "FAILS", "NOT caught", "MISMATCH", "ILL"})


@dataclass(frozen=True)
class Table:
    """Rows of text under named columns. `right`: the columns (by index) aligned right, numbers;
    `verdict`: the column whose red words (`RED`) are marked; `caption`: a line above the rows."""
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    right: frozenset[int] = frozenset()
    verdict: Optional[int] = 0
    caption: str = ""

    def __post_init__(self):
        bad = [i for i, r in enumerate(self.rows) if len(r) != len(self.columns)]
        if bad:
            raise ValueError(f"table: row {bad[0]} has {len(self.rows[bad[0]])} cells, expected "
                             f"{len(self.columns)} ({', '.join(self.columns)})")

    def __str__(self) -> str:
        widths = [max([len(c)] + [len(r[i]) for r in self.rows]) for i, c in enumerate(self.columns)]

        def line(cells):
            return "  ".join(c.rjust(w) if i in self.right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
        out = ([self.caption] if self.caption else []) + [line(self.columns)]
        return "\n".join(out + ["-" * len(out[-1])] + [line(r) for r in self.rows])

    def _repr_pretty_(self, p, cycle) -> None:     # IPython's text/plain
        p.text(str(self))

    def _repr_html_(self) -> str:
        def cell(tag, i, text):
            classes = ["gt-num"] if i in self.right else []
            if i == self.verdict and text.split(" (")[0] in RED:
                classes.append("gt-red")
            attr = f' class="{" ".join(classes)}"' if classes else ""
            return f"<{tag}{attr}>{html.escape(text)}</{tag}>"
        head = "".join(cell("th", i, c) for i, c in enumerate(self.columns))
        body = "".join("<tr>" + "".join(cell("td", i, c) for i, c in enumerate(r)) + "</tr>" for r in self.rows)
        caption = f"<caption>{html.escape(self.caption)}</caption>" if self.caption else ""
        return (f'<table class="dataframe gradtie-table">{caption}<thead><tr>{head}</tr></thead>'
                f"<tbody>{body}</tbody></table>")


@dataclass(frozen=True)
class Folded:
    """A table folded under a one-line summary (HTML `<details>`, closed until the reader opens
    it): the detail rows a verdict line above already sums up. Its text is the table's own."""
    summary: str
    table: Table

    def __str__(self) -> str:
        return str(self.table)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))

    def _repr_html_(self) -> str:
        return (f'<details class="gradtie-fold"><summary>{html.escape(self.summary)}</summary>'
                f"{self.table._repr_html_()}</details>")


def folded(table: Table, summary: str) -> Folded:
    """`table` shown folded under `summary` (e.g. "the 24 sites, one row each")."""
    if not summary.strip():
        raise ValueError("folded: give the summary line a reader clicks to open the table")
    return Folded(summary, table)


def shape_text(shape: Sequence[int]) -> str:
    """(64, 3, 3, 3) -> "64×3×3×3"; a scalar -> "–"."""
    return "×".join(map(str, shape)) or "–"


def ratio_text(ratio: float) -> str:
    """err/limit: two decimals, scientific past 1e4, "shape" for a node of the wrong shape or dtype."""
    return "shape" if not np.isfinite(ratio) else f"{ratio:.2f}" if ratio < 1e4 else f"{ratio:.1e}"


def tie(report, *, caption: str = "") -> Table:
    """A `TieReport`'s rows: verdict, node (" (0 in ℝ)" where the node is 0 in exact arithmetic),
    shape, M (the cells its BatchNorm averages over), the point's envelope, the limit the error is
    held to, the relative error and their ratio."""
    rows = tuple((r.verdict, r.name + (" (0 in ℝ)" if r.zero_in_reals else ""), shape_text(r.shape),
                  str(r.cells or "–"), f"{r.envelope:.1e}", f"{r.limit:.1e}", f"{r.rel:.1e}", ratio_text(r.ratio))
                 for r in report.rows)
    return Table(("verdict", "node", "shape", "M", "envelope", "limit", "rel err", "err/lim"), rows,
                 right=frozenset(range(3, 8)), caption=caption)


def stages(report, *, caption: str = "") -> Table:
    """A `StageTies` report in backward order: ok, stage, kind, nodes, the largest cotangent entry
    reaching it, its input row's error and limit, and its worst error over limit."""
    rows = []
    for t in report.backward_order():
        inp, cot = t.row("input") or t.rows[0], t.meta.get("cotangent_max")
        rows.append(("yes" if t.ok else "NO", t.net, t.meta.get("kind", ""), str(len(t.nodes)),
                     "–" if cot is None else f"{cot:.1e}", f"{inp.rel:.1e}", f"{inp.limit:.1e}",
                     f"{t.worst().ratio:.2g}"))
    return Table(("ok", "stage", "kind", "nodes", "max|dy|", "input err", "input lim", "worst err/lim"),
                 tuple(rows), right=frozenset(range(3, 8)), caption=caption)


def bugs(net=None, *, caption: str = "") -> Table:
    """The bug catalogue's entries (those that apply to `net`, given one): name, family, what is
    wrong, and what a check needs to plant it (`--replicas`, `--replica-counts`)."""
    from gradtie.checks import bugs as catalogue

    rows = tuple((b.name, b.family, b.breaks,
                  "--replica-counts" if b.needs_uneven else "--replicas" if b.replicas else "")
                 for b in catalogue.entries(net))
    needs = any(r[3] for r in rows)
    columns = ("bug", "family", "what is wrong") + (("needs",) if needs else ())
    return Table(columns, tuple(r if needs else r[:3] for r in rows), verdict=None, caption=caption)


def caught(report, *, ratios: bool = False, caption: str = "") -> Table:
    """A `CatalogueReport`, one row per planted bug: caught or not, the bug, the first node over its
    limit in backward order, the first β row (with the error over the limit when `ratios`: it moves
    with the machine's round-off)."""
    rows = tuple(("yes" if c.red else "NO", c.bug, c.first.name if c.first else "–",
                  c.first_beta.name if c.first_beta else "–") + ((f"{c.ratio:.1e}",) if ratios else ())
                 for c in report.caught)
    columns = ("caught", "bug", "first failing node", "first β row") + (("err/limit",) if ratios else ())
    return Table(columns, rows, right=frozenset({4}), caption=caption)


def census(report, *, caption: str = "") -> tuple[Table, Table]:
    """A `Smoothness` census as two tables: one row per pool (the windows of each class, the
    margin), and one row per clause of each hypothesis, its verdict first."""
    from gradtie.checks.census import CLASSES

    pools = Table(("pool", "reads", *CLASSES, "margin"),
                  tuple((p.pool, p.preactivation, *(str(p.counts[c]) for c in CLASSES), f"{p.margin:.2e}")
                        for p in report.pools),
                  right=frozenset(range(2, 3 + len(CLASSES))), verdict=None, caption=caption)
    return pools, hypotheses(report.hypotheses)


def hypotheses(hyps, *, caption: str = "") -> Table:
    """One row per clause of each hypothesis, then the statement it guards: holds, hypothesis,
    clause, and how many windows or cells break it."""
    rows = []
    for h in hyps:
        rows += [("yes" if c.holds else "NO", h.name, c.name, str(c.violated)) for c in h.clauses]
        rows.append(("HOLDS" if h.holds else "FAILS", h.name, "→ " + h.lean, str(h.violated)))
    return Table(("holds", "hypothesis", "clause", "violated"), tuple(rows), right=frozenset({3}),
                 caption=caption)


def fold_steps(steps, example: int = 0, decimals: int = 3) -> Table:
    """The head fold's six kit ops on one example (`head_checks.FoldSteps`): one row per op, its
    formula, then the row of `example`, one column per class."""
    ops = [("t", "target", steps.targets), ("softmaxRow", "p = softmax(z)", steps.p),
           ("subB", "d0 = p − t", steps.d0), ("scaleB", "a = α·t", steps.a), ("addVB", "d1 = d0 + a", steps.d1),
           ("shiftB", "d2 = d1 − α/K", steps.d2), ("divConstB", "dy = d2 / N", steps.dy)]
    rows = tuple((name, formula, *(f"{v + 0.0:.{decimals}f}" for v in value[example])) for name, formula, value in ops)
    return Table(("op", "formula", *(str(k) for k in range(steps.k))), rows, right=frozenset(range(2, 2 + steps.k)),
                 verdict=None, caption=f"example {example}, N = {steps.n}, K = {steps.k}, α = {steps.alpha:g}")


def bf16(report) -> tuple[Table, Table]:
    """A `Bf16Report` as two tables: one row per conv node (ok, node, its n, whether it is
    rnd(f32 node at rounded operands), its largest error over M, the bound and their ratio), then
    the stages against their VJP (`stages`)."""
    sites = Table(("ok", "conv node", "n", "= rnd(f32)", "max err/M", "bound", "ratio"),
                  tuple(("yes" if r.ok else "NO", r.label, str(r.n), "yes" if r.equal else "NO", f"{r.max_rel:.2e}",
                         f"{r.bound:.2e}", f"{r.ratio:.2f}") for r in report.sites),
                  right=frozenset({2, 4, 5, 6}))
    return sites, stages(report.stages)


def fd(rows, *, caption: str = "") -> Table:
    """Finite-difference rows (`checks.fd.derivatives`): verdict, node, the step h, the central
    difference and the rendered directional derivative, their relative error and its limit."""
    return Table(("verdict", "node", "h", "fd", "rendered", "rel err", "limit"),
                 tuple((r.verdict, r.name, f"{r.h:.1e}", f"{r.fd:+.6e}", f"{r.rendered:+.6e}", f"{r.rel:.1e}",
                        f"{r.limit:.1e}") for r in rows),
                 right=frozenset(range(2, 7)), caption=caption)


def sweep(report, *, ratios: bool = True, caption: str = "") -> Table:
    """A `stages.Sweep`, one row per N: the tie's verdict ("tied", "FAILED", "degenerate" where a
    BatchNorm sees M = 1, "–" where the parameter hypothesis fails), N, each hypothesis of the
    census, the nodes tied, the worst error over its limit (when `ratios`: it moves with the
    machine's round-off) and the smallest BatchNorm reduction M."""
    hyps = report.rows[0].smooth.hypotheses
    rows = []
    for r in report.rows:
        verdict = ("degenerate" if r.degenerate else "–" if r.tie is None
                   else "tied" if r.tie.ok else "FAILED")
        tied = "–" if r.tie is None else f"{sum(x.agrees for x in r.tie.nodes)}/{len(r.tie.nodes)}"
        small = r.degenerate or (r.tie.smallest_bn() if r.tie is not None else None)
        ratio = (("–" if r.tie is None else f"{r.ratio:.2g}",) if ratios else ())
        rows.append((verdict, str(r.n), *("holds" if r.holds(h.key) else "FAILS" for h in hyps), tied, *ratio,
                     str(small[1]) if small else "–"))
    columns = ("verdict", "N", *(h.name for h in hyps), "nodes tied", *(("worst err/lim",) if ratios else ()),
               "min M")
    return Table(columns, tuple(rows), right=frozenset({1, *range(2 + len(hyps), len(columns))}),
                 caption=caption or report.net)


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def replica_sums(report, *, caption: str = "") -> Table:
    """A bf16 `ReplicaReport` (`checks.bf16.replicas`), one row per conv weight node: ok, node,
    stride s and kernel k, whether every replica's node is rnd(S_r) bit for bit ("n/a" where the
    kind runs other sums than the reference), the node, all-reduce and formula errors over their
    bounds, |formula|/M over 2u, the share of entries that differ, and 0 at the identity rounding."""
    from gradtie.checks.bf16.kinds import U_BF16

    rows = []
    for r in report.rows:
        bit = _yes(r.nodes_rounded) if r.equal_required else ("(yes)" if r.nodes_rounded else "n/a")
        rows.append((_yes(r.ok), r.name + ".weight", f"{r.stride}/{r.kernel_size}", bit, f"{r.node_ratio:.3f}",
                     f"{r.reduce_ratio:.2f}", f"{r.formula_ratio:.2f}", f"{r.max_diff_rel / (2 * U_BF16):.3f}",
                     f"{r.differing:.1%}", _yes(r.identity_zero)))
    return Table(("ok", "node", "s/k", "rnd(S_r)", "node/B(n)", "all-reduce/bound", "formula/bound",
                  "|F|/M over 2u", "differing", "0 at id"), tuple(rows), right=frozenset(range(4, 9)),
                 caption=caption)


def exact_difference(report, *, caption: str = "") -> Table:
    """A `sync_bf16.ExactReport`, one row per conv weight node: within the summation-order bound at
    every entry, node, entries, whether the replicas ran the reference's sums, and the shares of
    entries exact, bounded, predicted by the controls (no term, no rounding) and with a nonzero term."""
    rows = tuple((_yes(r.within == r.entries), r.name + ".weight", str(r.entries), "yes" if r.same_sums else "no",
                  f"{r.exact / r.entries:.2%}", f"{r.within / r.entries:.2%}", f"{r.no_term / r.entries:.2%}",
                  f"{r.no_rounding / r.entries:.2%}", f"{r.nonzero / r.entries:.1%}") for r in report.rows)
    return Table(("bounded", "node", "entries", "shared sums", "exact", "within", "no term", "no rnd", "F ≠ 0"),
                 rows, right=frozenset({2, *range(4, 9)}), caption=caption)
