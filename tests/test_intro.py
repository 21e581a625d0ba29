"""The intro's "Try it" box runs as written: each `gradtie` command exits with the code its comment
promises, and the Python snippet's `check_vjp` passes (and raises `VJPMismatch` once its VJP is
broken). The commands are read from book/intro.md, so the page and the test cannot drift apart."""

import re
import shlex

import pytest

import gradtie
from gradtie import book, cli


def _try_it() -> str:
    page = (book.BOOK / "intro.md").read_text()
    start = page.index("```{admonition} Try it")
    return page[start:page.index("\n```\n", start)]


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"~~~{lang}\n(.*?)~~~", _try_it(), re.S)


def _commands() -> list[tuple[list[str], int]]:
    out = []
    for line in _blocks("bash")[0].strip().splitlines():
        command, comment = line.split("#", 1)
        out.append((shlex.split(command), int(re.search(r"exit (\d)", comment)[1])))
    return out


def test_the_try_it_box_holds_two_commands_and_a_snippet():
    assert [(argv[:2], code) for argv, code in _commands()] == [(["gradtie", "check"], 0), (["gradtie", "check"], 1)]
    assert "gradtie.check_vjp(" in _blocks("python")[0]


@pytest.mark.parametrize("index", [0, 1])
def test_each_command_exits_as_its_comment_says(index, capsys):
    argv, code = _commands()[index]
    assert cli.main(argv[1:]) == code, capsys.readouterr().out[-2000:]


def test_the_snippet_passes_and_a_broken_vjp_is_refused(capsys):
    snippet = _blocks("python")[0]
    exec(compile(snippet, "intro.md", "exec"), {})
    assert "finite differences in float64: agree" in capsys.readouterr().out
    broken = snippet.replace("return dz @ w.T, x.T @ dz", "return dz @ w.T, 1.01 * x.T @ dz")
    assert broken != snippet
    with pytest.raises(gradtie.VJPMismatch):
        exec(compile(broken, "intro.md", "exec"), {})
