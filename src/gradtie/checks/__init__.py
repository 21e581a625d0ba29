"""The tie kit: rendered nodes against autodiff and finite differences, census, germs, controls.

Autodiff appears here and in `gradtie.reference` only, as an oracle. Functions return reports and
print nothing.
"""

from . import fd
from .tie import TieReport, tie

__all__ = ["TieReport", "fd", "tie"]
