"""Every chapter passes at seeds 1, 2 and 3 at its ci sizes, not only at the seed it was executed at.

A chapter's bands state what holds for every valid parameter set; a band that holds at seed 0 only
is a defect this finds (the pools chapter's margin at seed 3 was one). Each run is a whole chapter
under papermill, so the sweep belongs to `make test-all` (about 20 minutes on a 2-core CPU, README).
"""

import pytest

from gradtie import book

SEEDS = (1, 2, 3)
CASES = [(c.name, seed) for c in book.CHAPTERS if "seed" in book.parameters_cell(c.name) for seed in SEEDS]


def test_the_sweep_covers_every_chapter_with_a_seed():
    seeded = {c.name for c in book.CHAPTERS if "seed" in book.parameters_cell(c.name)}
    assert {name for name, _ in CASES} == seeded and len(seeded) >= 8
    # the one chapter without a seed draws nothing: it reads the committed benchmark results
    assert {c.name for c in book.CHAPTERS} - seeded == {"performance"}


@pytest.mark.slow
@pytest.mark.parametrize("name, seed", CASES)
def test_chapter_passes_at_another_seed(tmp_path, name, seed):
    import papermill
    from papermill.exceptions import PapermillExecutionError

    try:
        source = book.source_notebook(name, tmp_path / f"{name}.source.ipynb")   # the reviewed .py
        papermill.execute_notebook(str(source), str(tmp_path / f"{name}.ipynb"),
                                   parameters={"seed": seed}, kernel_name="python3", cwd=str(book.NOTEBOOKS),
                                   progress_bar=False)
    except PapermillExecutionError as e:   # the failing cell's assert message names figure, band, parameters
        pytest.fail(f"{name} at seed {seed}, ci sizes: cell {e.exec_count}: {e.ename}: {e.evalue}", pytrace=False)
