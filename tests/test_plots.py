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
