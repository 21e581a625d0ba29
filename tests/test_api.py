"""The API page's examples run as written, one after the other in one namespace (the page's first
block sets up the point the others use), and each one's own assertions hold."""

import re

from gradtie import book


def _examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (book.BOOK / "api.md").read_text(), re.S)


def test_the_api_page_opens_each_section_with_an_example():
    page = (book.BOOK / "api.md").read_text()
    sections = re.split(r"\n## ", page)[1:]
    assert len(sections) >= 5 and all("```python" in s for s in sections)


def test_every_example_on_the_api_page_runs(capsys):
    namespace: dict = {}
    for i, block in enumerate(_examples()):
        exec(compile(block, f"api.md example {i}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "exit 0: tied" in out and "agree" in out.splitlines()[-1]   # check_vjp: both sides agree


def _documented():
    """(name, docstring) of every entry the API page documents, and of each member it lists."""
    import importlib
    import inspect

    page = (book.BOOK / "api.md").read_text()
    for name, options in re.findall(r"\.\. auto(?:class|function|data):: (\S+)((?:\n   :\w+:.*)*)", page):
        module, _, attr = name.rpartition(".")
        obj = getattr(importlib.import_module(module), attr)
        yield name, inspect.getdoc(obj) or ""
        members = re.search(r":members: (.*)", options)
        for member in (members.group(1).split(",") if members else ()):
            yield f"{name}.{member.strip()}", inspect.getdoc(getattr(obj, member.strip())) or ""


def _markup_problems(text: str) -> list[str]:
    import docutils.core

    tree = docutils.core.publish_doctree(text, settings_overrides={"report_level": 5, "warning_stream": False})
    return [n.astext() for n in tree.findall(lambda n: n.tagname in ("problematic", "system_message"))]


def test_every_documented_docstring_is_clean_markup():
    """The page is built with warnings as errors: a docstring that reStructuredText reads as markup
    (`|x|` a substitution, `x_` a reference) breaks `make book`. Checked here, without building."""
    found = {name: p for name, doc in _documented() if (p := _markup_problems(doc))}
    assert found == {}
    assert _markup_problems("the largest |spread| of a node") != []     # the check itself can fail
