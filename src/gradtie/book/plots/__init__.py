"""Every figure the book draws, a module per chapter (matching `notebooks/`).

Functions take a report and return a matplotlib Figure; chapters show it with `plt.show()` (PNG).
One message per figure, said in its title; labelled axes with units; convergence on log–log with an
O(h²) reference slope; controls in red; fixed size.
"""

import importlib


def __getattr__(name: str):
    """`plots.<chapter>`: a chapter's module, imported when the chapter first reads it (a chapter
    needs only its own; the chapters are `gradtie.book.CHAPTERS`)."""
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
