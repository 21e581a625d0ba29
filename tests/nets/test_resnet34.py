"""ResNet-34 end to end at drawn weights: the rendered chain equals autodiff of the forward, node by
node, in float64 (rows built by the tie kit, `tie_helpers`).

Kept quick: K = 10, batch 2, 32-px images (one case at 64 px), eager so that every case after the
first reuses the compiled ops of its shapes.
"""

from collections import Counter

import jax
import jax.numpy as jnp
import pytest

from gradtie import kit
from gradtie.nets import protocol, resnet34
from gradtie.ops import head, maxpool

import tie_helpers as th

N = 2
K = 10
CFG = resnet34.Config(num_classes=K)
NET = resnet34.NET


@pytest.fixture(scope="module")
def params():
    return th.f64(resnet34.NET.init(jax.random.PRNGKey(0), CFG, weights="drawn"))


@pytest.fixture(scope="module")
def point(params):
    """Random images, mixup targets, α = 0.1: the forward, computed once."""
    x = th.randn(1, (N, 3, 32, 32))
    t = th.soft_targets(N, K)
    logits, saved = resnet34.NET.forward(params, x, CFG)
    return dict(x=x, t=t, logits=logits, saved=saved)


@pytest.fixture(scope="module")
def tied_point(params, point):
    """... and at it the rendered chain and the oracle (the ties and their controls; `make test`
    leaves them to the chapters, see tests/conftest.py)."""
    x, t = point["x"], point["t"]
    dlogits = head.cotangent(point["logits"], t, 0.1)
    grads, dx = resnet34.NET.backward(params, point["saved"], dlogits, CFG)
    _, grads_ref, dx_ref = th.reference.oracle(NET, params, x, t, CFG, 0.1)
    return dict(point, dlogits=dlogits, grads=grads, dx=dx, grads_ref=grads_ref, dx_ref=dx_ref)


@pytest.mark.slow
def test_rendered_chain_equals_autodiff_f64(params, tied_point):
    point = tied_point
    assert list(point["grads"]) == list(params)
    th.assert_tied(point["grads"], point["grads_ref"], params)


@pytest.mark.slow
def test_input_cotangent_equals_autodiff_f64(tied_point):
    point = tied_point
    assert point["dx"].shape == point["x"].shape
    assert th.input_tied(point["dx"], point["dx_ref"])


CASES = {
    "photos-32px-labels-a0": (CFG, lambda: th.photos(N, 32), "labels", 0.0),
    "flat-32px-soft-a0.1": (CFG, lambda: th.flat_images(N, 32), "soft", 0.1),
    "randn-32px-conv-bias-labels-a0.1": (resnet34.Config(num_classes=K, conv_bias=True),
                                         lambda: th.randn(2, (N, 3, 32, 32)), "labels", 0.1),
    "photos-64px-labels-a0.1": (CFG, lambda: th.photos(N, 64), "labels", 0.1),
}
# the conv-bias case is the one net-level ResNet-34 tie `make test` runs; the Whole-net tie chapter
# ties the others' points (photos, flat images, 64 px in its cpu profile)
QUICK_CASES = ("randn-32px-conv-bias-labels-a0.1",)


@pytest.mark.parametrize("case", [c if c in QUICK_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_loss_and_grads_equal_autodiff_f64(params, case):
    cfg, images, targets, alpha = CASES[case]
    p = params if cfg == CFG else th.f64(resnet34.NET.init(jax.random.PRNGKey(3), cfg, weights="drawn"))
    x = images()
    t = th.labels(N, K) if targets == "labels" else th.soft_targets(N, K)
    loss, grads = resnet34.NET.loss_and_grads(p, x, t, cfg, label_smoothing=alpha)
    loss_ref, grads_ref = th.oracle_loss_and_grads(NET, p, x, t, cfg, alpha)
    assert th.loss_tied(loss, loss_ref)
    assert list(grads) == list(p)
    th.assert_tied(grads, grads_ref, p)


# ---- controls --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_doubled_cotangent_control_goes_red(params, tied_point):
    point = tied_point
    grads, dx = resnet34.NET.backward(params, point["saved"], 2 * point["dlogits"], CFG)
    assert set(th.untied(grads, point["grads_ref"], params)) == set(params)
    assert not th.input_tied(dx, point["dx_ref"])


@pytest.mark.slow
def test_swap_gamma_beta_control_goes_red(params, tied_point):
    point = tied_point
    grads = dict(point["grads"])
    a, b = "layer3.0.downsample.1.weight", "layer3.0.downsample.1.bias"
    grads[a], grads[b] = grads[b], grads[a]
    assert sorted(th.untied(grads, point["grads_ref"], params)) == [b, a]


@pytest.mark.slow
def test_projection_bn_reads_da_control_goes_red(params, tied_point):
    """Feeding the projection BN's β the cotangent of bn1 (not the block's da) fails the tie."""
    point = tied_point
    grads = dict(point["grads"])
    grads["layer2.0.downsample.1.bias"] = grads["layer2.0.bn1.bias"]
    assert th.untied(grads, point["grads_ref"], params) == ["layer2.0.downsample.1.bias"]


# ---- the eighteen stages ---------------------------------------------------------------------------

def test_eighteen_stages_compose_to_the_forward_bit_for_bit(params, point):
    pairs = resnet34.NET.stages(params, CFG)
    names = [name for name, _ in pairs]
    assert len(pairs) == 18
    assert names == (["stem"] + [f"layer{l}.{i}" for l, n in zip((1, 2, 3, 4), (3, 4, 6, 3)) for i in range(n)]
                     + ["head"])
    kinds = [s.kind for s in NET.stage_list(CFG)]
    assert kinds == ["stem"] + ["identity"] * 3 + (["downsample"] + ["identity"] * 3) \
        + (["downsample"] + ["identity"] * 5) + (["downsample"] + ["identity"] * 2) + ["head"]
    assert kinds.count("identity") == 13 and kinds.count("downsample") == 3
    a = point["x"]
    for _, f in pairs:
        a = f(a)
    assert jnp.array_equal(a, point["logits"])
    # control: seventeen of them (layer1.1 left out; shapes still fit) are not the forward
    b = point["x"]
    for name, f in pairs:
        b = b if name == "layer1.1" else f(b)
    assert b.shape == a.shape and not jnp.array_equal(b, point["logits"])


def test_stages_own_every_parameter_once_in_order(params):
    assert list(params) == [spec.name for spec in NET.param_specs(CFG)]
    assert [n for s in NET.stage_list(CFG) for n in s.params] == list(params)
    assert NET.stage_list(CFG)[0].params == ("conv1.weight", "bn1.weight", "bn1.bias")


def test_stem_pool_gather_at_argmax_is_the_net_bit_for_bit(params, point):
    r = resnet34.NET.pool_inputs(point["saved"])["stem.pool"]
    assert list(NET.pools) == ["stem.pool"] and r.shape == (N, 64, 16, 16)
    assert NET.pool_preactivations == {"stem.pool": "bn1"}
    sigma = maxpool.select(r, NET.pools["stem.pool"])
    logits_g, saved_g = resnet34.NET.forward(params, point["x"], CFG, selections={"stem.pool": sigma})
    assert jnp.array_equal(logits_g, point["logits"])
    assert jnp.array_equal(saved_g["stem"].sigma, sigma)


def test_saved_views(point):
    saved = point["saved"]
    pre = resnet34.NET.preactivations(saved)
    assert len(pre) == 1 + 2 * 16
    assert list(pre)[:3] == ["bn1", "layer1.0.bn1", "layer1.0.add"]
    assert jnp.array_equal(jnp.maximum(pre["bn1"], 0), resnet34.NET.pool_inputs(saved)["stem.pool"])
    assert pre["layer4.2.add"].shape == (N, 512, 1, 1)


def test_batch_stats_are_this_batch_and_drive_eval(params, point):
    running = resnet34.NET.batch_stats(point["saved"])
    assert len(running) == 2 * 36
    assert {"bn1.running_mean", "layer2.0.downsample.1.running_var", "layer4.2.bn2.running_mean"} <= set(running)
    assert list(running)[:2] == ["bn1.running_mean", "bn1.running_var"]
    c = point["saved"]["layer3.0"].proj.c
    assert th.rel_err(running["layer3.0.downsample.1.running_var"], jnp.var(c, axis=(0, 2, 3))) <= 1e-12
    logits_eval = resnet34.NET.forward_eval(params, running, point["x"], CFG)
    assert th.rel_err(logits_eval, point["logits"]) <= 1e-8
    assert th.rel_err(resnet34.NET.forward_eval(params, resnet34.NET.init_running(params, CFG), point["x"], CFG),
                      point["logits"]) > 1e-3


# ---- the kit ---------------------------------------------------------------------------------------

KIT_CALLS = {"conv_backward": 36, "conv_grad_weight": 36, "bn_backward": 36, "bn_nodes": 36, "relu_backward": 33,
             "pool_backward": 1, "residual_backward": 16, "gap_backward": 1, "dense_backward": 1,
             "dense_grad_weight": 1, "dense_grad_bias": 1}


@pytest.mark.parametrize("conv_bias", [False, True])
def test_backward_makes_every_op_call_through_its_kit(conv_bias):
    """At abstract shapes (nothing computed), a recording kit sees the chain's every op: 36 convs
    and BNs (stem, 32 in blocks, 3 projections), 33 ReLUs, the stem pool, 16 residual fan-ins,
    GAP and fc; the conv bias nodes exactly when the config has conv biases (each case the other's
    control)."""
    cfg = resnet34.Config(num_classes=K, conv_bias=conv_bias)
    params, x = protocol.abstract_inputs(NET, cfg, (N, 3, 32, 32))
    log = []

    def chain(p, x_):
        logits, saved = NET.forward(p, x_, cfg)
        return NET.backward(p, saved, logits, cfg, kit=kit.recording(kit.KIT, log))

    jax.eval_shape(chain, params, x)
    assert Counter(c.op for c in log) == {**KIT_CALLS, **({"conv_grad_bias": 36} if conv_bias else {})}
    projections = sorted(c.args[0] for c in log if c.op == "bn_backward" and "downsample" in c.args[0])
    assert projections == [f"layer{k}.0.downsample.1" for k in (2, 3, 4)]


# ---- jit, bad input --------------------------------------------------------------------------------

def test_loss_and_grads_traces_under_jit(params, point):
    """Tracing is where a check that needs concrete values would break; compiling it adds nothing."""
    step = jax.jit(resnet34.NET.loss_and_grads, static_argnames=("cfg", "label_smoothing"))
    lowered = step.lower(params, point["x"], th.labels(N, K), cfg=CFG, label_smoothing=0.1)
    loss, grads = jax.eval_shape(lambda p, x, t: resnet34.NET.loss_and_grads(p, x, t, CFG, 0.1),
                                 params, point["x"], point["t"])
    assert lowered is not None and loss.shape == () and set(grads) == set(params)
    logits, saved = jax.eval_shape(lambda p, x, s: resnet34.NET.forward(p, x, CFG, selections={"stem.pool": s}),
                                   params, point["x"], jnp.zeros((N, 64, 8, 8), jnp.int32))
    assert logits.shape == (N, K)


def _bad_calls(p, x):
    t = th.labels(N, K)
    return {
        "size 48": (lambda: resnet34.NET.forward(p, jnp.zeros((N, 3, 48, 48)), CFG), "multiple of 32"),
        "size 16": (lambda: resnet34.NET.forward(p, jnp.zeros((N, 3, 16, 16)), CFG), "multiple of 32"),
        "one channel": (lambda: resnet34.NET.forward(p, x[:, :1], CFG), "3 channels"),
        "rank 3": (lambda: resnet34.NET.loss_and_grads(p, x[0], t, CFG), "rank 4"),
        "targets width": (lambda: resnet34.NET.loss_and_grads(p, x, jnp.ones((N, 1000)) / 1000, CFG), r"\(2, 10\)"),
        "labels 2-D": (lambda: resnet34.NET.loss_and_grads(p, x, t[:, None], CFG), "labels"),
        "rows not summing": (lambda: resnet34.NET.loss_and_grads(p, x, jnp.full((N, K), 0.2), CFG), "sum to 1"),
        "K mismatch": (lambda: resnet34.NET.forward(p, x, resnet34.Config()),
                       r"fc.weight must have shape \(1000, 512\)"),
        "conv_bias mismatch": (lambda: resnet34.NET.forward(p, x, resnet34.Config(num_classes=K, conv_bias=True)),
                               "conv1.bias"),
        "missing key": (lambda: resnet34.NET.forward({k: v for k, v in p.items() if "layer4.0.downsample" not in k},
                                                 x, CFG), "layer4.0.downsample.0.weight"),
        "unknown pool": (lambda: resnet34.NET.forward(p, x, CFG, selections={"pool1": jnp.zeros(1, int)}), "stem.pool"),
    }


@pytest.mark.parametrize("case", list(_bad_calls({}, jnp.zeros((N, 3, 32, 32)))))
def test_bad_input_raises_value_error(params, point, case):
    call, match = _bad_calls(params, point["x"])[case]
    with pytest.raises(ValueError, match=match):
        call()
