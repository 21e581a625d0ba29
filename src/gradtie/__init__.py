"""gradtie: the rendered backward chain of two BatchNorm CNN train steps, tied to the gradient.

Subpackages: `gradtie.ops` (forward, rendered backward and parameter-gradient nodes per op family),
`gradtie.kit` (those ops as one value a chain is handed), `gradtie.nets` (the net protocol,
cifar8-BN and ResNet-34), `gradtie.rendered` (the rendered step), `gradtie.reference` (the autodiff
oracles) and `gradtie.checks` (the tie kit).

Check a net of your own (`gradtie.nets.protocol`) or one hand-written VJP:

    report = gradtie.check(net, params, x, targets)     # census, tie, finite differences; .exit_code
    gradtie.check_vjp(f, *args)                         # raises on a wrong VJP or a kink
"""

__version__ = "0.2.0"

from .checks.check import check  # noqa: E402
from .checks.vjp import NotSmooth, VJPMismatch, check_vjp  # noqa: E402

__all__ = ["NotSmooth", "VJPMismatch", "__version__", "check", "check_vjp"]
