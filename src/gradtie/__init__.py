"""gradtie: the rendered backward chain of two BatchNorm CNN train steps, tied to the gradient.

Subpackages: `gradtie.ops` (forward, rendered backward and parameter-gradient nodes per op family),
`gradtie.nets` (cifar8-BN and ResNet-34), `gradtie.reference` (autodiff oracles) and
`gradtie.checks` (the tie kit).
"""

__version__ = "0.1.0"
