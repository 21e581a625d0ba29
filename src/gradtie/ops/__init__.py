"""The op kit: one module per op family, forward, rendered backward and parameter nodes side by side.

No module here calls the autodiff API; `gradtie.reference` holds the oracles they are checked
against.
"""

from . import batchnorm, conv, dense, gap, head, maxpool, relu, residual

__all__ = ["batchnorm", "conv", "dense", "gap", "head", "maxpool", "relu", "residual"]
