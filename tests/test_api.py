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
