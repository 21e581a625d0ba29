"""The page tables added for wide listings (finite differences, the N sweep, the sync-bf16 replica and
exact-difference reports) put the verdict first and mark a failing row red. Rows are built by
hand: nothing is computed."""

from types import SimpleNamespace as NS

from gradtie.book import pages


def _verdict_first(table):
    html = table._repr_html_()
    return html.index("<th>" + table.columns[0]) < html.index("<th>" + table.columns[1])


def test_finite_difference_rows_verdict_first_and_red_when_failed():
    rows = [NS(verdict="ok", name="fc.weight", h=1e-4, fd=0.25, rendered=0.25, rel=1e-9, limit=1e-6),
            NS(verdict="FAILED", name="conv1.weight", h=2.5e-5, fd=-1.0, rendered=1.0, rel=2.0, limit=1e-6)]
    t = pages.fd(rows)
    assert t.columns[0] == "verdict" and [r[0] for r in t.rows] == ["ok", "FAILED"]
    html = t._repr_html_()
    assert html.count('class="gt-red"') == 1 and '<td class="gt-red">FAILED</td>' in html


def _sweep_row(n, holds, tie_ok=True, degenerate=None):
    hyp = NS(key="parameters", name="parameter gradients")
    tie = None if degenerate else NS(ok=tie_ok, nodes=[NS(agrees=tie_ok)] * 3, smallest_bn=lambda: ("bn1", 2 * n))
    return NS(n=n, smooth=NS(hypotheses=[hyp]), holds=lambda k: holds, tie=tie, degenerate=degenerate,
              ratio=0.01 if tie_ok else 50.0)


def test_the_sweep_table_says_tied_degenerate_or_failed_and_can_leave_the_ratios_out():
    report = NS(net="resnet34", rows=[_sweep_row(1, True, degenerate=("layer4.0.bn1", 1)), _sweep_row(2, True),
                                      _sweep_row(4, True, tie_ok=False)])
    t = pages.sweep(report)
    assert [r[0] for r in t.rows] == ["degenerate", "tied", "FAILED"]
    assert t.rows[0][-1] == "1" and t.rows[1][3] == "3/3" and "worst err/lim" in t.columns
    bare = pages.sweep(report, ratios=False)
    assert "worst err/lim" not in bare.columns and len(bare.columns) == len(t.columns) - 1
    assert '<td class="gt-red">FAILED</td>' in bare._repr_html_()


def test_the_sync_bf16_tables_put_the_verdict_first():
    row = NS(ok=False, name="conv1", stride=2, kernel_size=7, nodes_rounded=True, equal_required=True,
             node_ratio=0.2, reduce_ratio=0.0, formula_ratio=3.0, max_diff_rel=2.0 ** -9, differing=0.74,
             identity_zero=True)
    t = pages.replica_sums(NS(rows=[row]))
    assert t.rows[0][:3] == ("NO", "conv1.weight", "2/7") and t.rows[0][7] == "0.250"
    exact = NS(name="conv1", entries=100, same_sums=True, exact=100, within=99, no_term=26, no_rounding=0,
               nonzero=74)
    e = pages.exact_difference(NS(rows=[exact]))
    assert e.rows[0][0] == "NO" and e.rows[0][4] == "100.00%" and e.rows[0][-1] == "74.0%"
    assert all(_verdict_first(x) for x in (t, e)) and '<td class="gt-red">NO</td>' in t._repr_html_()


def test_a_folded_table_keeps_its_rows_and_text_under_a_closed_summary():
    t = pages.Table(("verdict", "site"), (("ok", "a"), ("NO", "b")))
    f = pages.folded(t, "two sites, one row each")
    html = f._repr_html_()
    assert html.startswith('<details class="gradtie-fold"><summary>two sites, one row each</summary>')
    assert " open" not in html.split(">")[0] and t._repr_html_() in html and str(f) == str(t)
    import pytest
    with pytest.raises(ValueError, match="summary"):
        pages.folded(t, " ")
