"""gradtie: the rendered backward chain of two BatchNorm CNN train steps, tied to the gradient.

Subpackages: `gradtie.ops` (forward, rendered backward and parameter-gradient nodes per op family),
`gradtie.kit` (those ops as one value a chain is handed), `gradtie.nets` (the net protocol,
cifar8-BN and ResNet-34), `gradtie.rendered` (the rendered step), `gradtie.reference` (the autodiff
oracles) and `gradtie.checks` (the tie kit). `gradtie.book` holds the book's support code (the
chapters' figures, pages, companions, claim map and build): it imports the kit, and nothing here
imports it.

Check a net of your own (`gradtie.nets.protocol`) or one hand-written VJP:

    report = gradtie.check(net, params, x, targets)     # census, tie, finite differences; .exit_code
    gradtie.check_vjp(f, *args)                         # raises on a wrong VJP or a kink

`gradtie.Point.of(net, params, x, targets, cfg)` is the validated point every check of
`gradtie.checks` takes (`tie(point)`, `stages.stage_ties(point)`, `bugs.run(point)`);
`gradtie.CheckOptions` says what `gradtie.check` runs besides the tie.
"""

__version__ = "0.2.0"

# read when first asked for: `import gradtie.ops` (or `gradtie --help`) does not load the checks
_LAZY = {"check": ("checks.check", "check"), "check_vjp": ("checks.vjp", "check_vjp"),
         "Point": ("checks.tie", "Point"), "CheckOptions": ("checks.check", "CheckOptions"),
         "NotSmooth": ("checks.vjp", "NotSmooth"), "VJPMismatch": ("checks.vjp", "VJPMismatch")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'gradtie' has no attribute {name!r}")
    import importlib
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(f".{module}", __name__), attr)


__all__ = ["CheckOptions", "NotSmooth", "Point", "VJPMismatch", "__version__", "check", "check_vjp"]
