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

# read when first asked for: `import gradtie.ops` (or `gradtie --help`) does not load the checks
_LAZY = {"check": ("checks.check", "check"), "check_vjp": ("checks.vjp", "check_vjp"),
         "NotSmooth": ("checks.vjp", "NotSmooth"), "VJPMismatch": ("checks.vjp", "VJPMismatch")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'gradtie' has no attribute {name!r}")
    import importlib
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(f".{module}", __name__), attr)


__all__ = ["NotSmooth", "VJPMismatch", "__version__", "check", "check_vjp"]
