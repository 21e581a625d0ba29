"""Every figure the book draws, a module per chapter (matching `notebooks/`).

Functions take a report and return a matplotlib Figure; chapters show it with `plt.show()` (PNG).
One message per figure, said in its title; labelled axes with units; convergence on log–log with an
O(h²) reference slope; controls in red; fixed size.
"""

import importlib

# one module per chapter, imported when a chapter first reads it (a chapter needs only its own)
CHAPTERS = ("bf16_erasure", "data_parallel", "head_fold", "performance", "pools", "stage_germs", "training",
            "whole_net_tie", "would_it_catch")


def __getattr__(name: str):
    if name in CHAPTERS:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
