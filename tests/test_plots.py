"""The figures' conventions (`gradtie.book.plots._style`): no wider than the book's column, no text under
the smallest font, no legend over the data, no bar clipped; shown on the headline figure with
made-up reports, and each rule seen failing on a figure built to break it."""

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from gradtie.book.plots import _style, would_it_catch  # noqa: E402


def _report(net, ratios):
    worst = SimpleNamespace(rel=3e-15, limit=1e-10)
    return SimpleNamespace(net=net, real=SimpleNamespace(worst=lambda: worst),
                           caught=[SimpleNamespace(bug=f"bug_{i}", ratio=r) for i, r in enumerate(ratios)])


def test_the_headline_figure_keeps_the_conventions_even_with_huge_and_shapeless_ratios():
    fig = would_it_catch.caught([_report("cifar8", [3e5, 2e13, np.inf]), _report("resnet34", [7e9, 4e14])])
    assert _style.problems(fig) == []
    plt.close(fig)


def test_each_convention_can_fail():
    fig, ax = plt.subplots(figsize=(10, 3))
    ax.barh([0], [5.0])
    ax.set_xlim(0, 2)
    ax.plot([0, 1], [0, 1], label="data")
    ax.legend(loc="center", fontsize=6)
    found = "\n".join(_style.problems(fig))
    assert "10.0 in wide" in found and "under 9 pt" in found and "a legend over the data" in found
    assert "a bar clipped" in found
    plt.close(fig)


def test_the_overview_keeps_the_conventions():
    fig = would_it_catch.overview([_report("cifar8", [3e5, 2e13, np.inf]), _report("resnet34", [7e9, 4e14])])
    assert _style.problems(fig) == []
    plt.close(fig)


def test_the_vjp_verdicts_keep_the_conventions_and_refuse_nothing_to_draw():
    import pytest

    from gradtie.book.plots import check_your_own

    rows = lambda *ratios: [SimpleNamespace(name=f"arg{i}", ratio=r) for i, r in enumerate(ratios)]  # noqa: E731
    fig = check_your_own.vjp_verdicts([("right", rows(1e-6, 2e-7)), ("planted", rows(4e13, np.inf))], names=("x", "w"))
    assert _style.problems(fig) == [] and len(fig.axes[0].patches) == 4
    red = [p for p in fig.axes[0].patches if p.get_facecolor() == matplotlib.colors.to_rgba(_style.CONTROL_COLOR)]
    assert len(red) == 2     # the rows over their limit, the wrong shape's (inf) included
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()][0] == "right: x"
    plt.close(fig)
    # a ratio of exactly 0 is said in words, and a tiny one still shows its bar
    fig = check_your_own.vjp_verdicts([("exact", rows(0.0, 1e-14))])
    ax = fig.axes[0]
    assert any("exactly" in t.get_text() for t in ax.texts) and ax.get_xlim()[0] <= 1e-15
    assert _style.problems(fig) == []
    plt.close(fig)
    with pytest.raises(ValueError, match="no rows"):
        check_your_own.vjp_verdicts([("empty", [])])


def test_the_bf16_erasure_overviews_keep_the_conventions():
    import pytest

    from gradtie.book.plots import bf16_erasure

    fig = bf16_erasure.kind_erasure([("forward s1", 0, False), ("weight grad s2", 0, False),
                                     ("control: dropped bias", 2_100_000_000, True)])
    assert _style.problems(fig) == []
    plt.close(fig)
    with pytest.raises(ValueError, match="no rows"):
        bf16_erasure.kind_erasure([])
    row = lambda name, r, peer=0.0: SimpleNamespace(name=name, exact_ratio=r, peer_exact_ratio=peer)  # noqa: E731
    typed = SimpleNamespace(erasure=lambda: [row("forward s1 [conv]", 0.02, 0.02), row("forward s1 [patches]", 0.0)],
                            controls=lambda: [row("forward s1 [conv]", 410.0), row("forward s1 [patches]", 920.0)])
    fig = bf16_erasure.typed_erasure(typed)
    assert _style.problems(fig) == [] and len(fig.axes[0].collections) == 3
    plt.close(fig)
