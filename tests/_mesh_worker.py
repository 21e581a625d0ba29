"""Runs a data-parallel check on 8 fake CPU devices and prints one JSON line of results.

    python tests/_mesh_worker.py tie {cifar8,resnet34}
    python tests/_mesh_worker.py control {cifar8,resnet34}
    python tests/_mesh_worker.py drift
    python tests/_mesh_worker.py step
    python tests/_mesh_worker.py errors

The device count must be fixed before jax initialises, and the test session has already imported
jax, so tests/test_parallel.py runs this script in a fresh interpreter.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

from gradtie import parallel, train  # noqa: E402
from gradtie.nets import cifar8, resnet34  # noqa: E402

REPLICAS = (2, 4, 8)
GLOBAL_BATCH = 8          # split 2, 4 and 8 ways: one single-device reference serves every R
NETS = {"cifar8": (cifar8, cifar8.Config(head_width=64)),
        "resnet34": (resnet34, resnet34.Config(num_classes=10))}


def batch(cfg, n, seed=1):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.uniform(size=(n, 3, 32, 32)))
    return x, jnp.asarray(rng.integers(0, cfg.num_classes, size=n))


def init64(net, cfg):
    """float64 parameters in signature order, from one jitted init (an eager init compiles a
    sampler per tensor shape, which dominates a small check)."""
    params = jax.jit(lambda key: {k: v.astype(jnp.float64) for k, v in net.init(key, cfg).items()})(
        jax.random.key(0))
    return {spec.name: params[spec.name] for spec in net.param_specs(cfg)}


def setup(name):
    net, cfg = NETS[name]
    params = init64(net, cfg)
    x, labels = batch(cfg, GLOBAL_BATCH)
    # int labels for cifar8, one-hot rows with label smoothing for resnet34: both target forms
    if name == "cifar8":
        return net, cfg, params, x, labels, 0.0
    return net, cfg, params, x, jax.nn.one_hot(labels, cfg.num_classes, dtype=jnp.float64), 0.1


def tie(name):
    net, cfg, params, x, targets, alpha = setup(name)
    ref = parallel.single_device(net, params, x, targets, cfg, label_smoothing=alpha)
    out = {}
    for r in REPLICAS:
        rep = parallel.tie(net, params, x, targets, cfg, mesh=parallel.data_mesh(r),
                           label_smoothing=alpha, reference=ref)
        out[str(r)] = {"ok": rep.ok, "max_rel": rep.max_rel, "nodes": len(rep.rows),
                       "loss_err": abs(rep.loss - rep.loss_single), "summary": rep.summary()}
    return out


def control(name):
    """Per-replica BatchNorm (R = 2) against the same single-device reference: must fail. The
    per-example BN variant couples no examples, so it ties without any synchronisation."""
    net, cfg, params, x, targets, alpha = setup(name)
    mesh = parallel.data_mesh(2)
    rep = parallel.tie(net, params, x, targets, cfg, mesh=mesh, sync_bn=False, label_smoothing=alpha)
    out = {"ok": rep.ok, "max_rel": rep.max_rel, "failed": len(rep.failed),
           "failed_names": [r.name for r in rep.failed], "summary": rep.summary()}
    if name == "cifar8":
        cfg_ex = dataclasses.replace(cfg, bn="example")
        ex = parallel.tie(net, params, x, targets, cfg_ex, mesh=mesh, sync_bn=False, label_smoothing=alpha)
        out["per_example"] = {"ok": ex.ok, "max_rel": ex.max_rel, "summary": ex.summary()}
    return out


def drift():
    mesh = parallel.data_mesh(8)
    rep = parallel.variance_drift([1.0, 1e2, 1e4], mesh=mesh, per_replica=4, channels=8, size=8)
    rep64 = parallel.variance_drift([1e4], mesh=mesh, per_replica=4, channels=8, size=8, dtype="float64")
    return {"rows": [r._asdict() for r in rep.rows], "rows64": [r._asdict() for r in rep64.rows]}


def step():
    """Two data-parallel train steps (R = 4, sync BN) per optimizer against the same update applied
    to the single-device rendered gradient and batch statistics at batch R·N."""
    cfg = cifar8.Config(head_width=64, conv_bias=False)   # no zero-in-ℝ nodes for Adam to amplify
    params = init64(cifar8, cfg)
    x, labels = batch(cfg, 8)
    mesh = parallel.data_mesh(4)
    out = {}
    for name in train.OPTIMIZERS:
        opt = train.make_optimizer(name)
        lr = train.DEFAULT_LR[name]

        @jax.jit
        def reference_update(state, grads, stats):
            p, o = opt.update(state.params, grads, state.opt_state, lr)
            return train.TrainState(p, o, train.update_running(state.running, stats, state.step),
                                    state.step + 1)

        dp = parallel.make_step(cifar8, cfg, opt, mesh=mesh)
        a = b = train.init_state(cifar8, cfg, params, opt)
        for _ in range(2):
            ref = parallel.single_device(cifar8, a.params, x, labels, cfg)
            a = reference_update(a, ref.grads, ref.stats)
            b, metrics = dp(b, x, labels, lr)
        rel = {}
        for part in ("params", "running"):
            for k in getattr(a, part):
                u, v = np.asarray(getattr(a, part)[k]), np.asarray(getattr(b, part)[k])
                rel[f"{part}/{k}"] = float(np.max(np.abs(u - v)) / max(np.max(np.abs(u)), 1e-300))
        out[name] = {"max_rel": max(rel.values()), "worst": max(rel, key=rel.get),
                     "order": list(b.params) == list(params), "step": int(b.step),
                     "loss_err": abs(float(ref.loss) - float(metrics["loss"])),
                     "accuracy_err": abs(float(ref.accuracy) - float(metrics["accuracy"]))}
    # bf16 convs, float32 parameters: the all-reduce stays float32 and the step stays finite
    cfg16 = cifar8.Config(head_width=64, bf16=True, conv_bias=False)
    p32 = {k: v.astype(jnp.float32) for k, v in params.items()}
    x32 = x.astype(jnp.float32)
    opt = train.make_optimizer("sgd")
    st, _ = parallel.make_step(cifar8, cfg16, opt, mesh=mesh)(train.init_state(cifar8, cfg16, p32, opt),
                                                              x32, labels, 0.1)
    g16 = parallel.loss_and_grads(cifar8, p32, x32, labels, cfg16, mesh=mesh)[1]
    out["bf16"] = {"finite": bool(all(np.all(np.isfinite(np.asarray(v))) for v in st.params.values())),
                   "dtypes": sorted({str(v.dtype) for v in g16.values()} | {str(v.dtype) for v in st.params.values()})}
    return out


def errors():
    out = {}
    net, cfg = NETS["cifar8"]
    params = {}         # every check below fires before the net is called
    x, labels = batch(cfg, 6)
    for what, call in [
        ("indivisible", lambda: parallel.loss_and_grads(net, params, x, labels, cfg,
                                                        mesh=parallel.data_mesh(4))),
        ("too_many", lambda: parallel.data_mesh(9)),
        ("bad_rows", lambda: parallel.loss_and_grads(net, params, x[:4], jnp.ones((4, 10)), cfg,
                                                     mesh=parallel.data_mesh(2))),
    ]:
        try:
            call()
            out[what] = None
        except ValueError as e:
            out[what] = str(e)
    return out


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd in ("tie", "control"):
        result = {"tie": tie, "control": control}[cmd](sys.argv[2])
    else:
        result = {"drift": drift, "step": step, "errors": errors}[cmd]()
    print(json.dumps(result))
