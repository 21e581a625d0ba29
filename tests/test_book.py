"""The book's chapters, table of contents and committed notebooks agree, so that nbval can never
pass having collected fewer notebooks than the book has chapters; parameters validate."""

import pytest

from gradtie import book


def _tree(tmp_path, names, toc_names, ipynbs):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "_toc.yml").write_text("".join(f"      - file: book/{n}\n" for n in toc_names))
    for n in names:
        (tmp_path / "notebooks" / f"{n}.py").write_text("")
    for n in ipynbs:
        (tmp_path / "notebooks" / f"{n}.ipynb").write_text("{}")


@pytest.fixture
def two_chapters(monkeypatch, tmp_path):
    monkeypatch.setattr(book, "ROOT", tmp_path)
    monkeypatch.setattr(book, "NOTEBOOKS", tmp_path / "notebooks")
    monkeypatch.setattr(book, "CHAPTERS", [book.Chapter("a", "A"), book.Chapter("b", "B")])
    return tmp_path


def test_agreeing_book_lists_every_chapter_notebook(two_chapters):
    _tree(two_chapters, ["a", "b"], ["a", "b"], ["a", "b"])
    assert [p.name for p in book.chapter_notebooks()] == ["a.ipynb", "b.ipynb"]


@pytest.mark.parametrize("toc, ipynbs, message", [
    (["a"], ["a", "b"], "b is not in _toc.yml"),
    (["a", "b"], ["a"], "notebooks/b.ipynb is missing"),
    (["a", "b"], ["a", "b", "c"], "notebooks/c.ipynb is not a chapter"),
])
def test_a_missing_or_stray_notebook_fails(two_chapters, toc, ipynbs, message):
    _tree(two_chapters, ["a", "b"], toc, ipynbs)
    with pytest.raises(ValueError, match=message):
        book.chapter_notebooks()


@pytest.mark.parametrize("kwargs, message", [
    ({"batch": 0}, "batch=0"), ({"net": "vgg"}, "expected one of"), ({"unknown": 1}, "unknown chapter parameter"),
])
def test_bad_chapter_parameters_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        book.validated(**kwargs)
