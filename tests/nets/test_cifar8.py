"""cifar8-BN end to end at drawn weights (γ ≠ 1, β and biases ≠ 0): the rendered chain equals autodiff
of the forward, node by node, in float64 (rows built by the tie kit, `tie_helpers`)."""

import dataclasses
import math
from collections import Counter

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import kit, prng
from gradtie.checks import bugs
from gradtie.nets import cifar8, protocol, resnet34
from gradtie.ops import conv
from gradtie.ops import head, maxpool

import tie_helpers as th

N = 4
K = 10
SHAPE = (N, 3, 32, 32)
NET = cifar8.NET


@pytest.fixture(scope="module")
def params():
    return th.f64(cifar8.NET.init(jax.random.PRNGKey(0), cifar8.Config(), weights="drawn"))


@pytest.fixture(scope="module")
def x():
    return th.randn(1, SHAPE)


def _images(kind):
    return {"randn": lambda: th.randn(1, SHAPE), "photos": lambda: th.photos(N, 32),
            "flat": lambda: th.flat_images(N, 32)}[kind]()


def _targets(kind):
    return th.labels(N, K) if kind == "labels" else th.soft_targets(N, K)


CASES = {
    "randn-soft-a0.1": (cifar8.Config(), "randn", "soft", 0.1),
    "randn-labels-a0": (cifar8.Config(), "randn", "labels", 0.0),
    "photos-labels-a0.1": (cifar8.Config(), "photos", "labels", 0.1),
    "photos-soft-a0": (cifar8.Config(), "photos", "soft", 0.0),
    "flat-labels-a0": (cifar8.Config(), "flat", "labels", 0.0),
    "flat-soft-a0.1": (cifar8.Config(), "flat", "soft", 0.1),
    "example-bn-randn": (cifar8.Config(bn="example"), "randn", "soft", 0.1),
    "example-bn-flat": (cifar8.Config(bn="example"), "flat", "labels", 0.0),
    "no-conv-bias-photos": (cifar8.Config(conv_bias=False), "photos", "labels", 0.1),
    "narrow-head-randn": (cifar8.Config(head_width=64), "randn", "labels", 0.1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_grads_equal_autodiff_f64(case):
    cfg, images, targets, alpha = CASES[case]
    p = th.f64(cifar8.NET.init(jax.random.PRNGKey(3), cfg, weights="drawn"))
    x, t = _images(images), _targets(targets)
    loss, grads = cifar8.NET.loss_and_grads(p, x, t, cfg, label_smoothing=alpha)
    loss_ref, grads_ref = th.oracle_loss_and_grads(NET, p, x, t, cfg, alpha)
    assert th.loss_tied(loss, loss_ref)
    assert list(grads) == list(p)
    th.assert_tied(grads, grads_ref, p)


@pytest.mark.parametrize("bn", ["batch", "example"])
def test_backward_equals_vjp_at_any_cotangent(params, x, bn):
    cfg = cifar8.Config(bn=bn)
    dlogits = th.randn(7, (N, K))
    logits, saved = cifar8.NET.forward(params, x, cfg)
    grads, dx = cifar8.NET.backward(params, saved, dlogits, cfg)
    grads_ref, dx_ref = th.reference.vjp(lambda p_, x_: cifar8.NET.forward(p_, x_, cfg)[0], params, x,
                                         cotangent=dlogits)
    th.assert_tied(grads, grads_ref, params)
    assert dx.shape == x.shape
    assert th.input_tied(dx, dx_ref)


def test_input_cotangent_equals_vjp_of_the_loss(params, x):
    cfg = cifar8.Config()
    t = th.soft_targets(N, K)
    logits, saved = cifar8.NET.forward(params, x, cfg)
    _, dx = cifar8.NET.backward(params, saved, head.cotangent(logits, t, 0.1), cfg)
    _, _, dx_ref = th.reference.oracle(NET, params, x, t, cfg, 0.1)
    assert th.input_tied(dx, dx_ref)


# ---- the gather model ------------------------------------------------------------------------------

def _argmax_selections(saved):
    return {name: maxpool.select(r, NET.pools[name]) for name, r in cifar8.NET.pool_inputs(saved).items()}


def test_gather_model_at_argmax_is_the_net_bit_for_bit(params, x):
    cfg = cifar8.Config()
    logits, saved = cifar8.NET.forward(params, x, cfg)
    selections = _argmax_selections(saved)
    logits_g, saved_g = cifar8.NET.forward(params, x, cfg, selections=selections)
    assert jnp.array_equal(logits, logits_g)
    dlogits = th.randn(2, (N, K))
    grads, dx = cifar8.NET.backward(params, saved, dlogits, cfg)
    grads_g, dx_g = cifar8.NET.backward(params, saved_g, dlogits, cfg)
    assert all(jnp.array_equal(grads[k], grads_g[k]) for k in grads)
    assert jnp.array_equal(dx, dx_g)


def _random_selections(saved, seed=5):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return {name: prng.randint(k, maxpool.select(r, NET.pools[name]).shape, 0, 4)
            for k, (name, r) in zip(keys, cifar8.NET.pool_inputs(saved).items())}


@pytest.fixture(scope="module")
def gather_point(params, x):
    """A random σ (not the argmax): the gather-model net is linear in each pool input, so smooth."""
    cfg = cifar8.Config()
    _, saved = cifar8.NET.forward(params, x, cfg)
    selections = _random_selections(saved)
    dlogits = th.randn(4, (N, K))
    grads_ref, dx_ref = th.reference.vjp(
        lambda p_, x_: cifar8.NET.forward(p_, x_, cfg, selections=selections)[0], params, x, cotangent=dlogits)
    return cfg, saved, selections, dlogits, grads_ref, dx_ref


def test_gather_model_backward_is_selscatter_at_any_selection(params, x, gather_point):
    cfg, _, selections, dlogits, grads_ref, dx_ref = gather_point
    _, saved_g = cifar8.NET.forward(params, x, cfg, selections=selections)
    grads, dx = cifar8.NET.backward(params, saved_g, dlogits, cfg)
    th.assert_tied(grads, grads_ref, params)
    assert th.input_tied(dx, dx_ref)


def test_max_pool_backward_on_the_gather_model_control_goes_red(params, gather_point):
    """The real pools' routing against the gather model's vjp at a random σ: must not tie."""
    cfg, saved, _, dlogits, grads_ref, _ = gather_point
    grads_max, _ = cifar8.NET.backward(params, saved, dlogits, cfg)
    assert th.untied(grads_max, grads_ref, params)


# ---- controls: every comparison above can fail -----------------------------------------------------

@pytest.fixture(scope="module")
def tie_point(params, x):
    cfg = cifar8.Config()
    t = th.soft_targets(N, K)
    logits, saved = cifar8.NET.forward(params, x, cfg)
    dlogits = head.cotangent(logits, t, 0.1)
    _, grads_ref = th.oracle_loss_and_grads(NET, params, x, t, cfg, 0.1)
    return cfg, saved, dlogits, grads_ref


def test_tie_point_is_tied(params, tie_point):
    cfg, saved, dlogits, grads_ref = tie_point
    grads, _ = cifar8.NET.backward(params, saved, dlogits, cfg)
    th.assert_tied(grads, grads_ref, params)


def test_doubled_cotangent_control_goes_red(params, tie_point):
    cfg, saved, dlogits, grads_ref = tie_point
    grads, _ = cifar8.NET.backward(params, saved, 2 * dlogits, cfg)
    assert set(th.untied(grads, grads_ref, params)) >= {n for n in params if not th.zero_in_reals(n, params)}


def test_swap_gamma_beta_control_goes_red(params, tie_point):
    cfg, saved, dlogits, grads_ref = tie_point
    grads, _ = cifar8.NET.backward(params, saved, dlogits, cfg)
    grads["bn3.weight"], grads["bn3.bias"] = grads["bn3.bias"], grads["bn3.weight"]
    assert sorted(th.untied(grads, grads_ref, params)) == ["bn3.bias", "bn3.weight"]


def test_conv_bias_floor_still_sees_a_wrong_node(params, tie_point):
    """The absolute floor for zero-in-ℝ nodes is not blind: β's node in conv1.bias's place fails."""
    cfg, saved, dlogits, grads_ref = tie_point
    grads, _ = cifar8.NET.backward(params, saved, dlogits, cfg)
    grads["conv1.bias"] = grads["bn1.bias"]
    assert th.untied(grads, grads_ref, params) == ["conv1.bias"]


def test_missing_node_control_goes_red(params, tie_point):
    cfg, saved, dlogits, grads_ref = tie_point
    grads, _ = cifar8.NET.backward(params, saved, dlogits, cfg)
    assert list(grads) == list(params)  # signature order
    del grads["fc2.bias"]
    assert th.untied(grads, grads_ref, params) == ["fc2.bias"]


def test_doubled_cotangent_input_control_goes_red(params, x):
    cfg = cifar8.Config()
    dlogits = th.randn(7, (N, K))
    _, saved = cifar8.NET.forward(params, x, cfg)
    _, dx = cifar8.NET.backward(params, saved, 2 * dlogits, cfg)
    dx_ref = th.oracle_input_cotangent(NET, params, x, cfg, dlogits)
    assert not th.input_tied(dx, dx_ref)


# ---- the kit: the rendered chain calls every op through the kit it is handed ----------------------

KIT_CALLS = {"conv_backward": 8, "conv_grad_weight": 8, "conv_grad_bias": 8, "bn_backward": 8, "bn_nodes": 8,
             "relu_backward": 10, "pool_backward": 4, "dense_backward": 3, "dense_grad_weight": 3,
             "dense_grad_bias": 3}


def test_backward_makes_every_op_call_through_its_kit(params, tie_point):
    """A recording kit sees every op backward and node of the chain, each BN site by its name, and
    recording changes no bit (a kit is all the chain reads besides the saved record)."""
    cfg, saved, dlogits, _ = tie_point
    log = []
    grads, dx = cifar8.NET.backward(params, saved, dlogits, cfg, kit=kit.recording(kit.KIT, log))
    assert Counter(c.op for c in log) == KIT_CALLS
    assert sorted(c.args[0] for c in log if c.op == "bn_nodes") == [f"bn{j}" for j in range(1, 9)]
    grads_real, dx_real = cifar8.NET.backward(params, saved, dlogits, cfg)
    assert all(jnp.array_equal(grads[k], grads_real[k]) for k in params) and jnp.array_equal(dx, dx_real)
    # control: a kit with one op left out of the recording is not seen making that call
    log_without = []
    cifar8.NET.backward(params, saved, dlogits, cfg,
                    kit=kit.recording(kit.KIT, log_without, ops=[op for op in kit.OPS if op != "bn_nodes"]))
    assert Counter(c.op for c in log_without) == {k: v for k, v in KIT_CALLS.items() if k != "bn_nodes"}


def test_planted_kit_breaks_exactly_the_nodes_it_replaces(params, tie_point):
    """`bn_swap_dgamma_dbeta` (the Whole-net tie's γ↔β control) is another kit for the same net: every BN's γ
    and β node goes red and nothing else does, while the real kit, called the same way, ties."""
    cfg, saved, dlogits, grads_ref = tie_point
    chain = bugs.plant("bn_swap_dgamma_dbeta", NET)
    assert chain.net is NET and chain.kit != kit.KIT and chain.label == "cifar8 + bn_swap_dgamma_dbeta"
    grads, _ = chain.net.backward(params, saved, dlogits, cfg, kit=chain.kit)
    assert sorted(th.untied(grads, grads_ref, params)) == sorted(f"bn{j}.{w}" for j in range(1, 9)
                                                                for w in ("weight", "bias"))
    th.assert_tied(cifar8.NET.backward(params, saved, dlogits, cfg, kit=kit.KIT)[0], grads_ref, params)


# ---- padded batches: the validity mask is an argument --------------------------------------------

def test_padded_batch_is_the_batch_of_its_valid_rows(params, x):
    """forward(valid=) hands the mask to every BatchNorm, whose saved record carries it to the
    backward: statistics, logits and cotangents of the real rows as if the padding were not there,
    and dx = 0 on the padding (the chain hands padded rows a zero cotangent at the logits)."""
    cfg = cifar8.Config()
    valid = jnp.asarray([1.0, 1.0, 1.0, 0.0])
    junk = x.at[3].set(5 * th.randn(9, SHAPE[1:]))
    logits, saved = cifar8.NET.forward(params, junk, cfg, valid=valid)
    layers = cifar8.NET.bn_layers(saved)
    assert len(layers) == 8 and all(jnp.array_equal(layer.valid, valid) for layer in layers.values())
    logits0, saved0 = cifar8.NET.forward(params, x[:3], cfg)
    stats, stats0 = cifar8.NET.batch_stats(saved), cifar8.NET.batch_stats(saved0)
    assert max(th.rel_err(stats[k], stats0[k]) for k in stats0) <= 1e-12
    assert th.rel_err(logits[:3], logits0) <= 1e-12
    dlogits = th.randn(7, (N, K)) * valid[:, None]
    grads, dx = cifar8.NET.backward(params, saved, dlogits, cfg)
    grads0, dx0 = cifar8.NET.backward(params, saved0, dlogits[:3], cfg)
    assert th.rel_err(dx[:3], dx0) <= 1e-12 and jnp.all(dx[3] == 0)
    th.assert_tied(grads, grads0, params)
    # control: the same batch without the mask keeps no mask and moves every statistic and logit
    logits1, saved1 = cifar8.NET.forward(params, junk, cfg)
    assert all(layer.valid is None for layer in cifar8.NET.bn_layers(saved1).values())
    assert th.rel_err(cifar8.NET.batch_stats(saved1)["bn1.running_var"], stats0["bn1.running_var"]) > 1e-2
    assert th.rel_err(logits1[:3], logits0) > 1e-3


# ---- stages, saved views, running statistics -------------------------------------------------------

def test_five_stages_compose_to_the_forward_bit_for_bit(params, x):
    cfg = cifar8.Config()
    logits, _ = cifar8.NET.forward(params, x, cfg)
    pairs = cifar8.NET.stages(params, cfg)
    assert [name for name, _ in pairs] == ["stage1", "stage2", "stage3", "stage4", "head"]
    assert [s.kind for s in NET.stage_list(cfg)] == ["conv"] * 4 + ["head"]
    a = x
    for _, f in pairs:
        a = f(a)
    assert jnp.array_equal(a, logits)
    # control: one stage read from parameters a single ulp away cannot give the same logits
    nudged = dict(params, **{"bn3.weight": jnp.nextafter(params["bn3.weight"], 2.0)})
    b = x
    for (name, f), (_, g) in zip(pairs, cifar8.NET.stages(nudged, cfg)):
        b = g(b) if name == "stage2" else f(b)
    assert not jnp.array_equal(b, logits)


def test_seventeen_cert_layers_are_the_five_stage_net_op_for_op(params, x):
    """`cifar8.LAYERS` (the suite's seventeen `cifar8BbnLayer`s: (conv→BN→ReLU)² and a pool per
    stage, fc1, ReLU, fc2, ReLU, fc3) gives the net's forward and rendered backward bit for bit."""
    cfg = cifar8.Config()
    layers = cifar8.LAYERS.stage_list(cfg)
    assert len(layers) == 17 and Counter(s.kind for s in layers) == {"conv-bn-relu": 8, "pool": 4, "dense": 3,
                                                                     "relu": 2}
    assert [n for s in layers for n in s.params] == list(params)
    logits, saved = NET.forward(params, x, cfg)
    logits_l, saved_l = cifar8.LAYERS.forward(params, x, cfg)
    assert jnp.array_equal(logits_l, logits)
    assert list(cifar8.LAYERS.preactivations(saved_l)) == list(NET.preactivations(saved))
    assert list(cifar8.LAYERS.pool_inputs(saved_l)) == list(NET.pools)
    dlogits = th.randn(2, (N, K))
    grads, dx = NET.backward(params, saved, dlogits, cfg)
    grads_l, dx_l = cifar8.LAYERS.backward(params, saved_l, dlogits, cfg)
    assert all(jnp.array_equal(grads_l[k], grads[k]) for k in params) and jnp.array_equal(dx_l, dx)
    # control: the same layers with one ReLU left out (the shapes still fit) are not the net
    short = dataclasses.replace(cifar8.LAYERS, stage_list=lambda c: [s for s in cifar8.LAYERS.stage_list(c)
                                                                     if s.name != "relu(fc1)"])
    assert not jnp.array_equal(short.forward(params, x, cfg)[0], logits)


def test_stages_own_every_parameter_once_in_order(params):
    names = [n for s in NET.stage_list(cifar8.Config()) for n in s.params]
    assert names == list(params)


def test_summary_rows(params):
    rows = cifar8.NET.summary(params, cifar8.Config(), (N, 3, 32, 32))
    assert [r.output_shape for r in rows] == [(N, 16, 16, 16), (N, 16, 8, 8), (N, 32, 4, 4), (N, 32, 2, 2), (N, 10)]
    assert sum(r.params for r in rows) == 374_010
    assert "374,010" in protocol.format_summary(rows)


def test_saved_views(params, x):
    _, saved = cifar8.NET.forward(params, x, cifar8.Config())
    pre = cifar8.NET.preactivations(saved)
    assert list(pre) == [f"bn{j}" for j in range(1, 9)] + ["fc1", "fc2"]
    pools = cifar8.NET.pool_inputs(saved)
    assert list(pools) == list(NET.pools) == ["pool1", "pool2", "pool3", "pool4"]
    for name, layer in NET.pool_preactivations.items():  # each pool reads the ReLU of that BN output
        assert jnp.array_equal(pools[name], jnp.maximum(pre[layer], 0))
    assert pre["fc1"].shape == (N, 512)
    assert jax.tree.leaves(saved)  # a pytree of arrays


def test_batch_stats_are_this_batch_and_drive_eval(params, x):
    cfg = cifar8.Config()
    logits, saved = cifar8.NET.forward(params, x, cfg)
    running = cifar8.NET.batch_stats(saved)
    assert list(running) == [f"bn{j}.running_{s}" for j in range(1, 9) for s in ("mean", "var")]
    c1 = saved["stage1"].layer1.c
    np.testing.assert_allclose(running["bn1.running_mean"], np.mean(np.asarray(c1), axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(running["bn1.running_var"], np.var(np.asarray(c1), axis=(0, 2, 3)), rtol=1e-12)
    # eval mode with this batch's own statistics is the train-mode forward
    assert th.rel_err(cifar8.NET.forward_eval(params, running, x, cfg), logits) <= 1e-12
    # control: PyTorch's initial running statistics give other logits
    assert th.rel_err(cifar8.NET.forward_eval(params, cifar8.NET.init_running(params, cfg), x, cfg), logits) > 1e-3


def test_per_example_bn_eval_is_train(params, x):
    cfg = cifar8.Config(bn="example")
    logits, saved = cifar8.NET.forward(params, x, cfg)
    assert cifar8.NET.batch_stats(saved)["bn1.running_mean"].shape == (16,)
    assert jnp.array_equal(cifar8.NET.forward_eval(params, cifar8.NET.init_running(params, cfg), x, cfg), logits)
    # per-example statistics: one example's logits do not depend on the others
    logits_other, _ = cifar8.NET.forward(params, x.at[1:].set(x[1:] ** 2), cfg)
    assert th.rel_err(logits_other[0], logits[0]) <= 1e-12
    assert th.rel_err(logits_other[1], logits[1]) > 1e-3


# ---- init ------------------------------------------------------------------------------------------

def test_init_names_layouts_and_rules():
    cfg = cifar8.Config()
    p = cifar8.NET.init(jax.random.PRNGKey(0), cfg)
    assert list(p) == [s.name for s in NET.param_specs(cfg)]
    assert list(p)[:4] == ["conv1.weight", "conv1.bias", "bn1.weight", "bn1.bias"]
    assert list(p)[-6:] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
    assert p["conv1.weight"].shape == (16, 3, 3, 3) and p["fc1.weight"].shape == (512, 128)
    assert all(a.dtype == jnp.float32 for a in p.values())
    for j in range(1, 9):
        assert jnp.all(p[f"bn{j}.weight"] == 1) and jnp.all(p[f"bn{j}.bias"] == 0)
        assert jnp.all(p[f"conv{j}.bias"] == 0)
    # He fan-out and Glorot standard deviations, within sampling error of these sizes
    assert abs(float(jnp.std(p["conv8.weight"])) / math.sqrt(2 / (32 * 9)) - 1) < 0.05
    assert abs(float(jnp.std(p["fc2.weight"])) / math.sqrt(2 / (512 + 512)) - 1) < 0.02
    assert abs(float(jnp.std(p["fc1.weight"])) / math.sqrt(2 / (128 + 512)) - 1) < 0.03
    q = cifar8.NET.init(jax.random.PRNGKey(1), cfg)
    assert not jnp.array_equal(p["conv8.weight"], q["conv8.weight"])
    assert "conv1.bias" not in cifar8.NET.init(jax.random.PRNGKey(0), cifar8.Config(conv_bias=False))


# ---- bad input -------------------------------------------------------------------------------------

def _bad_calls(p, x):
    cfg = cifar8.Config()
    t = th.labels(N, K)
    missing = {k: v for k, v in p.items() if k != "bn5.bias"}
    wrong = dict(p, **{"fc3.weight": jnp.zeros((9, 512))})
    return {
        "size 28": (lambda: cifar8.NET.forward(p, x[:, :, :28, :28], cfg), "32"),
        "size 64": (lambda: cifar8.NET.loss_and_grads(p, jnp.zeros((N, 3, 64, 64)), t, cfg), "32"),
        "one channel": (lambda: cifar8.NET.forward(p, x[:, :1], cfg), "3 channels"),
        "NHWC": (lambda: cifar8.NET.forward(p, jnp.transpose(x, (0, 2, 3, 1)), cfg), "3 channels"),
        "rank 3": (lambda: cifar8.NET.forward(p, x[0], cfg), "rank 4"),
        "int pixels": (lambda: cifar8.NET.forward(p, jnp.zeros(SHAPE, jnp.int32), cfg), "float"),
        "targets width": (lambda: cifar8.NET.loss_and_grads(p, x, jnp.ones((N, 9)) / 9, cfg), r"\(4, 10\)"),
        "labels length": (lambda: cifar8.NET.loss_and_grads(p, x, t[:3], cfg), "labels"),
        "label range": (lambda: cifar8.NET.loss_and_grads(p, x, t.at[0].set(10), cfg), "0…9"),
        "rows not summing": (lambda: cifar8.NET.loss_and_grads(p, x, jnp.full((N, K), 0.2), cfg), "sum to 1"),
        "missing key": (lambda: cifar8.NET.forward(missing, x, cfg), "bn5.bias"),
        "extra key": (lambda: cifar8.NET.forward(dict(p, extra=jnp.zeros(3)), x, cfg), "extra"),
        "biases without conv_bias": (lambda: cifar8.NET.forward(p, x, cifar8.Config(conv_bias=False)), "conv1.bias"),
        "wrong shape": (lambda: cifar8.NET.loss_and_grads(wrong, x, t, cfg), r"fc3.weight must have shape \(10, 512\)"),
        "narrow cfg": (lambda: cifar8.NET.forward(p, x, cifar8.Config(head_width=64)), "fc1.weight"),
        "unknown pool": (lambda: cifar8.NET.forward(p, x, cfg, selections={"pool5": jnp.zeros(1, int)}), "pool5"),
        "selection shape": (lambda: cifar8.NET.forward(p, x, cfg, selections={"pool2": jnp.zeros((N, 16, 4, 4), int)}),
                            "σ"),
        "running missing": (lambda: cifar8.NET.forward_eval(p, {}, x, cfg), "running"),
        "saved of another net": (lambda: cifar8.NET.backward(p, {"stem": None}, jnp.zeros((N, K)), cfg), "stage1"),
        "bn kind": (lambda: cifar8.Config(bn="layer"), "'batch' or 'example'"),
        "cfg of another net": (lambda: cifar8.NET.forward(p, x, resnet34.Config()), "cfg must be a Config"),
        "mask length": (lambda: cifar8.NET.forward(p, x, cfg, valid=jnp.ones(N - 1)), r"valid must have shape \(4,\)"),
    }


@pytest.mark.parametrize("case", list(_bad_calls({}, jnp.zeros(SHAPE))))
def test_bad_input_raises_value_error(params, x, case):
    call, match = _bad_calls(params, x)[case]
    with pytest.raises(ValueError, match=match):
        call()


# ---- jit ---------------------------------------------------------------------------------------------

def test_jit_loss_and_grads_equals_eager(params, x):
    cfg, t = cifar8.Config(), th.labels(N, K)
    step = jax.jit(cifar8.NET.loss_and_grads, static_argnames=("cfg", "label_smoothing"))
    loss_j, grads_j = step(params, x, t, cfg=cfg, label_smoothing=0.1)
    loss, grads = cifar8.NET.loss_and_grads(params, x, t, cfg, label_smoothing=0.1)
    assert abs(float(loss_j) - float(loss)) <= 1e-12 * abs(float(loss))
    assert set(grads_j) == set(grads)
    assert all(th.rel_err(grads_j[k], grads[k]) <= 1e-12 for k in grads if not th.zero_in_reals(k, params))


def test_jit_forward_with_selections_and_backward(params, x):
    cfg = cifar8.Config()
    logits, saved = cifar8.NET.forward(params, x, cfg)
    selections = _argmax_selections(saved)
    fwd = jax.jit(cifar8.NET.forward, static_argnums=2)
    logits_j, saved_j = fwd(params, x, cfg, selections=selections)
    assert th.rel_err(logits_j, logits) <= 1e-12
    assert jnp.array_equal(saved_j["stage3"].sigma, selections["pool3"])
    # the saved pytree a jitted forward hands back feeds the rendered backward
    grads_j, dx_j = cifar8.NET.backward(params, saved_j, logits, cfg)
    grads, dx = cifar8.NET.backward(params, saved, logits, cfg)
    assert th.rel_err(dx_j, dx) <= 1e-10
    assert all(th.rel_err(grads_j[k], grads[k]) <= 1e-10 for k in params if not th.zero_in_reals(k, params))


def _conv_sites(jaxpr):
    """(operand dtypes, result dtype) of every convolution in a jaxpr, sub-jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "conv_general_dilated":
            out.append((tuple(str(v.aval.dtype) for v in eqn.invars), str(eqn.outvars[0].aval.dtype)))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    out += _conv_sites(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    out += _conv_sites(sub)
    return out


def _weight_gradient_calls(n: int) -> int:
    """Convolutions the 8 weight gradients run: one each, or one per tile where the CPU cuts a
    site into tiles (`conv.grad_weight_tiles`)."""
    total = 0
    for size in (32, 32, 16, 16, 8, 8, 4, 4):
        tiles = conv.grad_weight_tiles(n, size, size, jnp.float32)
        total += 1 if tiles is None else -(-n // tiles[0]) * -(-size // tiles[1])
    return total


@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_rounds_every_conv_site_and_nothing_else(params, x, bf16):
    """bf16 operands at every conv site (8 forward, 8 input backwards, the 8 weight gradients' calls,
    tiled on the CPU), float32 accumulation, float32 everywhere else; the float32 config (the
    control) has no bf16 conv."""
    cfg = cifar8.Config(bf16=bf16)
    p32 = {k: v.astype(jnp.float32) for k, v in params.items()}
    closed = jax.make_jaxpr(lambda p, x_, t: cifar8.NET.loss_and_grads(p, x_, t, cfg))(
        p32, x.astype(jnp.float32), th.labels(N, K))
    sites = _conv_sites(closed.jaxpr)
    operand = "bfloat16" if bf16 else "float32"
    assert len(sites) == 16 + _weight_gradient_calls(N)
    assert sites == [((operand, operand), "float32")] * len(sites)
    assert [str(v.aval.dtype) for v in closed.jaxpr.outvars] == ["float32"] * (1 + len(params))


@pytest.mark.parametrize("formulation, sites", [("conv", 24), ("patches", 0)])
def test_config_conv_formulation_pins_every_conv_site(params, x, formulation, sites):
    """cfg.conv_formulation reaches all 24 conv sites: each one XLA's convolution, or none left (each
    one patches · weights). The two configs are each other's control."""
    cfg = cifar8.Config(conv_formulation=formulation)
    closed = jax.make_jaxpr(lambda p, x_, t: cifar8.NET.loss_and_grads(p, x_, t, cfg))(params, x, th.labels(N, K))
    assert len(_conv_sites(closed.jaxpr)) == sites
