"""A chapter's bare asserts explain themselves in a kernel: values, then the chapter's parameters."""

import pytest
from IPython.core.interactiveshell import InteractiveShell

from gradtie import book
from gradtie.book.assertions import explain_asserts


@pytest.fixture
def shell():
    sh = InteractiveShell.instance()
    yield sh
    InteractiveShell.clear_instance()


def test_a_bare_assert_names_its_values_and_the_parameters(shell):
    assert shell.run_cell("from gradtie import book\np = book.validated(batch=2, seed=3)").success
    result = shell.run_cell("margin = 0.9\nassert margin > 1")
    message = str(result.error_in_exec)
    assert "assert 0.9 > 1" in message and "batch=2, seed=3" in message, message
    # an assert's own message comes first, and a passing cell is untouched
    result = shell.run_cell("assert margin > 1, 'pool margin, band > 1'")
    assert str(result.error_in_exec).startswith("pool margin, band > 1"), result.error_in_exec
    assert shell.run_cell("assert margin < 1\nok = True").success and shell.user_ns["ok"]
    # cells that open with comments, with and without an assert, still compile
    assert shell.run_cell('# a comment\n# another\nprint(f"x {1}"\n      f"y")\n').success
    assert shell.run_cell('# a comment\n\nassert margin < 1, (f"m {margin}"\n  f" band")\n').success


def test_outside_a_kernel_nothing_is_installed():
    assert explain_asserts({"seed": 0}) is False
    assert book.validated(seed=1).seed == 1
