"""Runs a data-parallel check on 8 fake CPU devices and prints one JSON line of results.

    python tests/_mesh_worker.py tie {cifar8,resnet34}
    python tests/_mesh_worker.py uneven
    python tests/_mesh_worker.py control
    python tests/_mesh_worker.py catalogue {cifar8,resnet34}
    python tests/_mesh_worker.py drift
    python tests/_mesh_worker.py step
    python tests/_mesh_worker.py errors
    python tests/_mesh_worker.py policy

The device count must be fixed before jax initialises, and the test session has already imported
jax, so tests/test_parallel.py runs this script in a fresh interpreter. Every tie runs at drawn
weights (γ ≠ 1, β ≠ 0) through `checks.tie.tie` on R replicas, the one verdict path; a planted bug is
the `Chain` `checks.bugs.plant` returns, run in every replica.
"""

import os
import sys

from gradtie.fake_devices import request_host_devices  # noqa: E402  (no JAX yet: it reads the count)

request_host_devices(8)
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

from gradtie import data, parallel, train  # noqa: E402
from gradtie.checks import bugs  # noqa: E402
from gradtie.checks.check import run_check  # noqa: E402
from gradtie.checks.tie import Point, reference_at, tie as tie_net  # noqa: E402
from gradtie.nets import cifar8, resnet34  # noqa: E402

REPLICAS = (2, 4, 8)
GLOBAL_BATCH = 8          # split 2, 4 and 8 ways: one single-device reference serves every R
NETS = {"cifar8": (cifar8.NET, cifar8.Config(head_width=64)),
        "resnet34": (resnet34.NET, resnet34.Config(num_classes=10))}


def init64(net, cfg, weights="drawn"):
    """float64 parameters in signature order (drawn: γ ~ U(0.5,1.5), β and biases nonzero)."""
    params = net.init(jax.random.key(0), cfg, weights=weights)
    return {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}


def setup(name, n=GLOBAL_BATCH):
    net, cfg = NETS[name]
    x, t = data.photo_batch(n, 32, cfg.num_classes)
    # label smoothing where the render has it (ResNet-34), none for cifar8
    return net, cfg, init64(net, cfg), x, t, 0.1 if name == "resnet34" else 0.0


def row(rep):
    """What the tests read of a TieReport."""
    worst = rep.worst()
    return {"ok": rep.ok, "nodes": len(rep.nodes), "rows": len(rep.rows), "loss_ok": rep.row("loss").ok,
            "input_ok": rep.row("input").ok, "worst_ratio": worst.rel / worst.limit, "worst_rel": worst.rel,
            "failed": [r.name for r in rep.failed],
            "first": rep.first_failure().name if rep.first_failure() else None,
            "ill": len(rep.ill_conditioned), "summary": rep.summary()}


def tie(name):
    """The mesh step at R = 2, 4, 8 (N = 4, 2, 1) against one float64 oracle at batch 8."""
    net, cfg, params, x, t, alpha = setup(name)
    point = reference_at(net, params, x, t, cfg, label_smoothing=alpha)
    return {str(r): row(tie_net(point, replicas=r))
            for r in REPLICAS}


def uneven():
    """Replicas holding different counts (cifar8, batch 4), one of them nothing: tied to one device
    at the concatenated batch; the plain mean of replica means red where counts differ; padding
    contributes nothing (junk in the padded rows changes no bit). The Data-parallel chapter ties
    ResNet-34 at 3+1 and shows the plain mean red there and green at 2+2."""
    net, cfg, params, x, t, alpha = setup("cifar8", 4)
    point = reference_at(net, params, x, t, cfg, label_smoothing=alpha)
    out = {"1+2+0+1": row(tie_net(point, counts=(1, 2, 0, 1)))}
    bug = bugs.plant("sync_plain_mean_of_means", net)
    out["bug 3+1"] = row(tie_net(point, bug, counts=(3, 1)))
    # the padded batch by hand: zeros, then junk, in the padding
    mesh = parallel.data_mesh(2)
    xs, ts, valid = parallel.padded(x, t, (3, 1))
    runs = []
    for fill in (0.0, 1.0):
        xj = np.where(valid[:, None, None, None] > 0, xs, fill * np.random.default_rng(5).uniform(size=xs.shape))
        runs.append(parallel.forward_backward(net, params, jnp.asarray(xj), jnp.asarray(ts), cfg, mesh=mesh,
                                              valid=jnp.asarray(valid)))
    a, b = runs
    out["junk_changes_no_bit"] = bool(all(np.array_equal(a.grads[k], b.grads[k]) for k in params)
                                      and np.array_equal(a.dx, b.dx) and float(a.loss) == float(b.loss))
    out["padded_dx_zero"] = bool(np.all(np.asarray(b.dx)[valid == 0] == 0))
    out["valid_dx_rows"] = int(np.sum(np.any(np.asarray(b.dx)[valid == 1] != 0, axis=(1, 2, 3))))
    return out


def control():
    """Per-replica BatchNorm (R = 2, cifar8) against the single-device oracle: must fail. The
    per-example BN variant couples no examples, so it ties without any synchronisation."""
    net, cfg, params, x, t, alpha = setup("cifar8", 4)
    out = {"per_replica": row(tie_net(Point.of(net, params, x, t, cfg), replicas=2, sync_bn=False))}
    cfg_ex = dataclasses.replace(cfg, bn="example")
    out["per_example"] = row(tie_net(Point.of(net, params, x, t, cfg_ex), replicas=2, sync_bn=False))
    return out


def catalogue(name):
    """The synchronised-BN catalogue entries through `gradtie check`'s own path (run_check), two
    replicas, batch 4 of photos, drawn weights: each must exit 1; the real chain at the uneven split
    exits 0."""
    out = {}
    for bug, counts in [("sync_dgamma_dbeta_reduced_twice", None), ("sync_local_means_backward", None),
                        ("sync_plain_mean_of_means", (3, 1)), (None, (3, 1))]:
        rep = run_check(name, batch=4, data="photos", replicas=2, plant_bug=bug, replica_counts=counts)
        first = rep.tie.first_failure()
        out[bug or "real 3+1"] = {"exit": rep.exit_code, "first": first.name if first else None,
                                  "summary": rep.summary()}
    return out


def drift():
    mesh = parallel.data_mesh(8)
    rep = parallel.variance_drift([1.0, 1e2, 1e4], mesh=mesh, per_replica=4, channels=8, size=8)
    rep64 = parallel.variance_drift([1e4], mesh=mesh, per_replica=4, channels=8, size=8, dtype="float64")
    return {"rows": [r._asdict() for r in rep.rows], "rows64": [r._asdict() for r in rep64.rows]}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-300))


def step():
    """Two data-parallel train steps (R = 4, sync BN) per optimizer against the same update applied
    to the single-device rendered gradient and batch statistics at batch R·N; then an uneven step
    (counts 3, 0, 2, 1) against the single device at the concatenated batch."""
    cfg = cifar8.Config(head_width=64, conv_bias=False)   # no zero-in-ℝ nodes for Adam to amplify
    net = cifar8.NET
    params = init64(net, cfg)
    x, t = data.photo_batch(8, 32, cfg.num_classes)
    labels = jnp.argmax(t, axis=1)
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

        dp = parallel.make_step(net, cfg, opt, mesh=mesh)
        a = b = train.init_state(net, cfg, params, opt)
        for _ in range(2):
            ref = parallel.single_device(net, a.params, x, labels, cfg)
            a = reference_update(a, ref.grads, ref.stats)
            b, metrics = dp(b, x, labels, lr)
        rel = {f"{part}/{k}": _rel(getattr(a, part)[k], getattr(b, part)[k])
               for part in ("params", "running") for k in getattr(a, part)}
        out[name] = {"max_rel": max(rel.values()), "worst": max(rel, key=rel.get),
                     "order": list(b.params) == list(params), "step": int(b.step),
                     "loss_err": abs(float(ref.loss) - float(metrics["loss"])),
                     "accuracy_err": abs(float(ref.accuracy) - float(metrics["accuracy"]))}
    # an uneven last batch: the same rendered step at the concatenated 6 examples on one device
    x6, labels6 = x[:6], labels[:6]
    ref = parallel.single_device(net, params, x6, labels6, cfg)
    got = parallel.forward_backward(net, params, x6, labels6, cfg, mesh=mesh, counts=(3, 0, 2, 1))
    out["uneven"] = {"grads": max(_rel(ref.grads[k], got.grads[k]) for k in params),
                     "stats": max(_rel(ref.stats[k], got.stats[k]) for k in ref.stats),
                     "dx": _rel(ref.dx, got.dx), "loss_err": abs(float(ref.loss) - float(got.loss)),
                     "accuracy_err": abs(float(ref.accuracy) - float(got.accuracy))}
    # bf16 convs, float32 parameters: the all-reduce stays float32 and the step stays finite
    cfg16 = cifar8.Config(head_width=64, bf16=True, conv_bias=False)
    p32 = {k: v.astype(jnp.float32) for k, v in params.items()}
    x32 = x.astype(jnp.float32)
    opt = train.make_optimizer("sgd")
    st, _ = parallel.make_step(net, cfg16, opt, mesh=mesh)(train.init_state(net, cfg16, p32, opt), x32, labels, 0.1)
    g16 = parallel.loss_and_grads(net, p32, x32, labels, cfg16, mesh=mesh)[1]
    out["bf16"] = {"finite": bool(all(np.all(np.isfinite(np.asarray(v))) for v in st.params.values())),
                   "dtypes": sorted({str(v.dtype) for v in g16.values()} | {str(v.dtype) for v in st.params.values()})}
    return out


def _all_reduce_dtypes(hlo: str) -> list[str]:
    """The element types every all-reduce of an optimized HLO program returns."""
    import re
    return [t for line in hlo.splitlines() if " all-reduce(" in line
            for t in re.findall(r"\b(bf16|f16|f32|f64)\[", line.split(" all-reduce(")[0])]


def policy():
    """The data-parallel step under the bf16 execution policy: BatchNorm statistics and parameter
    nodes all-reduced in float32 (read off the compiled program), and the mesh step as far from the
    float32 one as one device under bf16 is."""
    from gradtie.kit import KIT
    net = cifar8.NET
    cfg32, cfg16 = cifar8.Config(head_width=64), cifar8.Config(head_width=64, policy="bf16")
    x, t = data.photo_batch(8, 32, 10)
    params = {k: jnp.asarray(v, jnp.float32) for k, v in init64(net, cfg32).items()}
    x, t = x.astype(jnp.float32), t.astype(jnp.float32)
    g32 = parallel.single_device(net, params, x, t, cfg32).grads
    one16 = parallel.single_device(net, params, x, t, cfg16).grads
    out = {}
    for r in (2, 4):
        mesh = parallel.data_mesh(r)
        mesh16 = parallel.forward_backward(net, params, x, t, cfg16, mesh=mesh).grads
        fn = parallel._compiled(net, KIT, cfg16, mesh, 0.0, True, True, False, False)
        hlo = fn.lower(dict(params), x, t).compile().as_text()
        dist = {name: max(_rel(g32[k], g[k]) for k in params if not (k.startswith("conv") and k.endswith("bias")))
                for name, g in (("one", one16), ("mesh", mesh16))}
        out[str(r)] = {"all_reduce": sorted(set(_all_reduce_dtypes(hlo))), "n_all_reduce": len(_all_reduce_dtypes(hlo)),
                       "dtypes": sorted({str(v.dtype) for v in mesh16.values()}),
                       "finite": bool(all(np.all(np.isfinite(np.asarray(v))) for v in mesh16.values())), **dist}
    return out


def errors():
    out = {}
    net, cfg = NETS["cifar8"]
    params = {}         # every check below fires before the net is called
    x, t = data.photo_batch(6, 32, cfg.num_classes)
    labels = jnp.argmax(t, axis=1)
    mesh2, mesh4 = parallel.data_mesh(2), parallel.data_mesh(4)
    for what, call in [
        ("indivisible", lambda: parallel.loss_and_grads(net, params, x, labels, cfg, mesh=mesh4)),
        ("too_many", lambda: parallel.data_mesh(9)),
        ("bad_rows", lambda: parallel.loss_and_grads(net, params, x[:4], jnp.ones((4, 10)), cfg, mesh=mesh2)),
        ("counts_sum", lambda: parallel.loss_and_grads(net, params, x, labels, cfg, mesh=mesh2, counts=(3, 1))),
        ("counts_length", lambda: parallel.loss_and_grads(net, params, x, labels, cfg, mesh=mesh2, counts=(3, 2, 1))),
        ("counts_empty", lambda: parallel.loss_and_grads(net, params, x[:0], labels[:0], cfg, mesh=mesh2,
                                                         counts=(0, 0))),
        ("valid_values", lambda: parallel.forward_backward(net, params, x, labels, cfg, mesh=mesh2,
                                                           valid=jnp.asarray([1, 1, 0.5, 0, 1, 1.0]))),
        ("counts_and_valid", lambda: parallel.forward_backward(net, params, x, labels, cfg, mesh=mesh2,
                                                               counts=(3, 3), valid=jnp.ones(6))),
        ("tie_counts_replicas", lambda: tie_net(Point(net, cfg, params, x, t), replicas=3, counts=(3, 3))),
    ]:
        try:
            call()
            out[what] = None
        except ValueError as e:
            out[what] = str(e)
    return out


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd in ("tie", "catalogue"):
        result = {"tie": tie, "catalogue": catalogue}[cmd](sys.argv[2])
    else:
        result = {"uneven": uneven, "control": control, "drift": drift, "step": step, "errors": errors,
                  "policy": policy}[cmd]()
    print(json.dumps(result))
