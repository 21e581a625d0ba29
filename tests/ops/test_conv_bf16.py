"""The bf16 kinds of conv (forward, input backward, weight grad, strides 1 and 2): erasure at
rnd = identity, the rounding identity node = rnd(f32 node at rounded operands), the bound B(n)
against float64, and the rounding functions themselves; each claim with a control that fails.

The bound and the exact values are computed here, independently of `gradtie.checks.bf16`. Each case
is one jitted function: XLA compiles dominate the runtime on CPU.
"""

from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from gradtie.nets import cifar8, resnet34
from gradtie.ops import conv
from gradtie.rendered import QUICK

U, V = 2.0 ** -8, 2.0 ** -24   # bf16 and float32 unit roundoff
OPS = ("forward", "backward", "grad_weight")


def node_bound(n: int) -> float:
    """The bound: B(n) = ((1+v)^(n+1) − 1)(1+u)² + 2u + u², plus u(1 + B(n)) for the result's rounding."""
    b = ((1 + V) ** (n + 1) - 1) * (1 + U) ** 2 + 2 * U + U ** 2
    return b + U * (1 + b)


# (N, C, O, size, k, stride): odd and even sizes (the strided backward's high padding), k = 1, 3, 7
CASES = [(2, 3, 4, 9, 3, 1), (2, 5, 4, 9, 3, 2), (2, 4, 6, 8, 3, 2), (3, 6, 5, 8, 1, 2), (2, 3, 8, 12, 7, 2)]
IDS = [f"N{n}C{c}O{o}s{h}k{k}st{s}" for n, c, o, h, k, s in CASES]


def operands(case, seed=0, positive=False):
    n, c, o, h, k, s = case
    rng = np.random.default_rng(seed)
    draw = lambda *shape: np.abs(rng.standard_normal(shape)) if positive else rng.standard_normal(shape)
    h2 = conv.out_size(h, k, s)
    x, w, b, dy = (jnp.asarray(draw(*shape), jnp.float32)
                   for shape in ((n, c, h, h), (o, c, k, k), (o,), (n, o, h2, h2)))
    return x, w, b, dy


def nodes(x, w, b, dy, stride, rnd, formulation=None):
    """The three conv nodes at these operands (rnd None: the f32 ops)."""
    kw = dict(stride=stride, rnd=rnd, formulation=formulation)
    return (conv.forward(x, w, b, **kw)[0], conv.backward(w, dy, input_shape=x.shape, **kw),
            conv.grad_weight(x, dy, kernel_size=w.shape[2], **kw))


def widen(a):
    return a.astype(jnp.float32)


def rounded_reference(x, w, b, dy, stride, rnd, formulation=None):
    """rnd(f32 node at rounded operands): the f32 ops on rnd(x), rnd(W), rnd(dy), rounded once; the
    forward's bias added after, in float32."""
    y, dx, dw = nodes(widen(rnd(x)), widen(rnd(w)), None, widen(rnd(dy)), stride, None, formulation)
    return widen(rnd(y)) + b[None, :, None, None], widen(rnd(dx)), widen(rnd(dw))


def evaluate(x, w, b, dy, stride, rnd):
    """f32 peers, the kinds at identity, the kinds under rnd (bias-free forward for the bound), the
    rounded reference, and per output the exact float64 value and the magnitude sum Σ|a|·|b|."""
    f32 = nodes(x, w, b, dy, stride, None)
    ident = nodes(x, w, b, dy, stride, conv.identity)
    kind = nodes(x, w, b, dy, stride, rnd)
    kind_nobias = (conv.forward(x, w, stride=stride, rnd=rnd)[0],) + kind[1:]
    x64, w64, dy64 = (a.astype(jnp.float64) for a in (x, w, dy))
    exact = nodes(x64, w64, None, dy64, stride, None)
    mag = nodes(jnp.abs(x64), jnp.abs(w64), None, jnp.abs(dy64), stride, None)
    return f32, ident, kind, kind_nobias, rounded_reference(x, w, b, dy, stride, rnd), exact, mag


def lengths(case):
    """Contraction length per node: C·k², O·k², N·H'·W'."""
    n, c, o, h, k, s = case
    return c * k * k, o * k * k, n * conv.out_size(h, k, s) ** 2


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module", params=list(zip(CASES, IDS)), ids=IDS)
def case(request):
    c, _ = request.param
    x, w, b, dy = operands(c)
    return c, (x, w, b, dy), evaluate_both(x, w, b, dy, c[5])


@partial(jax.jit, static_argnames="stride", compiler_options=QUICK)
def evaluate_both(x, w, b, dy, stride):
    """One compile per case: `evaluate` under both bf16 roundings."""
    return {name: evaluate(x, w, b, dy, stride, rnd)
            for name, rnd in (("nearest", conv.round_bf16), ("bf16", conv.bf16_operand))}


# ---- erasure ----------------------------------------------------------------------------------

def test_kinds_at_identity_equal_f32_peers_bit_for_bit(case):
    _, _, out = case
    f32, ident = out["nearest"][0], out["nearest"][1]
    for op, a, b in zip(OPS, ident, f32):
        assert same_bits(a, b), op


def test_control_dropped_bias_breaks_erasure(case):
    _, (x, w, b, dy), out = case
    no_bias = conv.forward(x, w, stride=case[0][5], rnd=conv.identity)[0]
    assert not same_bits(no_bias, out["nearest"][0][0])


# ---- node = rnd(f32 node at rounded operands) --------------------------------------------------

@pytest.mark.parametrize("rounding", ["nearest", "bf16"])
def test_kinds_equal_rounded_f32_node_at_rounded_operands(case, rounding):
    _, _, out = case
    kind, reference = out[rounding][2], out[rounding][4]
    for op, a, b in zip(OPS, kind, reference):
        assert a.dtype == jnp.float32, op
        assert same_bits(a, b), op


def test_typed_and_nearest_rounding_give_the_same_bits(case):
    _, _, out = case
    for op, a, b in zip(OPS, out["nearest"][2], out["bf16"][2]):
        assert same_bits(a, b), op


def test_control_rounding_inside_the_batch_sum_breaks_the_identity(case):
    c, (x, w, b, dy), out = case
    k, s = w.shape[2], c[5]
    per_example = sum(conv.grad_weight(x[i:i + 1], dy[i:i + 1], kernel_size=k, stride=s, rnd=conv.round_bf16)
                      for i in range(x.shape[0]))
    assert not same_bits(per_example, out["nearest"][4][2])


def test_control_result_only_rounding_breaks_the_identity(case):
    c, (x, w, b, dy), out = case
    y = widen(conv.round_bf16(conv.forward(x, w, stride=c[5])[0])) + b[None, :, None, None]
    assert not same_bits(y, out["nearest"][4][0])


# ---- the bound ----------------------------------------------------------------------------------

def error_ratios(kind_nodes, exact, mag, case):
    """Per node: max over outputs of |node − exact| / (Σ|a|·|b| · node_bound(n))."""
    out = []
    for got, want, m, n in zip(kind_nodes, exact, mag, lengths(case)):
        got, want, m = (np.asarray(a, np.float64) for a in (got, want, m))
        err = np.abs(got - want)
        assert np.all(err[m == 0] == 0)                     # no products: the node is exactly 0
        out.append(float(np.max(err[m > 0] / m[m > 0])) / node_bound(n))
    return out


@pytest.mark.parametrize("rounding", ["nearest", "bf16"])
def test_kinds_error_under_the_spec_bound(case, rounding):
    c, _, out = case
    _, _, _, kind_nobias, _, exact, mag = out[rounding]
    ratios = error_ratios(kind_nobias, exact, mag, c)
    assert max(ratios) <= 1.0, ratios
    # not vacuous: the error is bf16-sized (float32 alone would sit near 2⁻²⁴ of the bound's scale)
    assert min(ratios) > 2.0 ** -6, ratios


def test_control_bf16_accumulation_breaks_the_bound():
    """Every partial sum rounded to bf16, on positive data (partial sums grow, each step loses up to
    u of them): the error grows like n·u and leaves the bound."""
    c = (1, 16, 4, 6, 3, 1)
    x, w, _, _ = operands(c, seed=1, positive=True)
    rx, rw = np.asarray(conv.round_bf16(x), np.float64), np.asarray(conv.round_bf16(w), np.float64)
    xpad = np.pad(rx, ((0, 0), (0, 0), (1, 1), (1, 1)))
    i, j = 2, 3
    prods = (xpad[0, :, i:i + 3, j:j + 3][None] * rw).reshape(4, -1)          # [O, C·k·k], exact
    acc = np.zeros(4)
    for p in prods.T:
        acc = np.asarray((acc + p).astype(np.float32).astype(ml_dtypes.bfloat16), np.float64)
    exact = (np.pad(np.asarray(x, np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))[0, :, i:i + 3, j:j + 3][None]
             * np.asarray(w, np.float64)).reshape(4, -1).sum(1)
    mag = exact  # positive data: Σ|a|·|b| = Σ a·b
    assert np.max(np.abs(acc - exact) / mag) > node_bound(prods.shape[1])


def test_spec_bound_values_for_resnet_forward_convs():
    """B(n) is about 0.0078–0.0081 for ResNet-34's forward convs, n = 147 … 4608."""
    b = lambda n: ((1 + V) ** (n + 1) - 1) * (1 + U) ** 2 + 2 * U + U ** 2
    assert (round(b(147), 4), round(b(4608), 4)) == (0.0078, 0.0081)


# ---- the rounding functions -----------------------------------------------------------------------

def test_round_bf16_is_the_f32_to_bf16_conversion():
    rng = np.random.default_rng(3)
    a = (rng.standard_normal(4096) * 2.0 ** rng.integers(-130, 120, 4096)).astype(np.float32)
    bits = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00008000, 0x80018000, 0x80000000],
                    np.uint32)  # ties to even (down, up), just below a tie, overflow, subnormal ties, −0
    a = np.concatenate([a, bits.view(np.float32)])
    got = np.asarray(conv.round_bf16(jnp.asarray(a)))
    want = a.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert got.dtype == np.float32
    assert got.tobytes() == want.tobytes()


def test_round_bf16_on_float64_rounds_once():
    """Nearest bf16 of a float64 value, ties to even, without the double rounding through float32."""
    one = 1.0
    cases = {one + 2 ** -8: one,                            # tie: down to even
             one + 3 * 2 ** -8: one + 2 ** -6,              # tie: up to even
             one + 2 ** -8 + 2 ** -40: one + 2 ** -7,       # just above the tie (float32 would lose 2⁻⁴⁰)
             -(one + 2 ** -8 + 2 ** -40): -(one + 2 ** -7), 3.0: 3.0}
    got = np.asarray(conv.round_bf16(jnp.asarray(list(cases), jnp.float64)))
    assert got.tolist() == list(cases.values())
    # control: the float32 route rounds twice and gets the third case wrong
    assert np.float64(one + 2 ** -8 + 2 ** -40).astype(np.float32).astype(ml_dtypes.bfloat16) == 1.0


@pytest.mark.parametrize("formulation", ["conv", "patches"])
def test_kinds_erase_and_round_in_either_formulation(formulation):
    """The formulation is configuration (`Config.conv_formulation`): XLA's convolution or patches ·
    weights, the kinds erase and round alike in both. Control: a forward without its bias."""
    c = CASES[1]
    x, w, b, dy = operands(c)
    run = jax.jit(partial(nodes, stride=c[5], formulation=formulation), static_argnames="rnd")
    for a, f32 in zip(run(x, w, b, dy, rnd=conv.identity), run(x, w, b, dy, rnd=None)):
        assert same_bits(a, f32)
    want = rounded_reference(x, w, b, dy, c[5], conv.round_bf16, formulation)
    for a, r in zip(run(x, w, b, dy, rnd=conv.round_bf16), want):
        assert same_bits(a, r)
    assert not same_bits(run(x, w, None, dy, rnd=conv.identity)[0], run(x, w, b, dy, rnd=None)[0])


def test_rounding_functions_by_name():
    assert conv.named_rounding("identity") is conv.identity
    assert conv.named_rounding("nearest") is conv.round_bf16
    assert conv.named_rounding("bf16") is conv.bf16_operand
    assert conv.named_rounding(conv.round_bf16) is conv.round_bf16
    with pytest.raises(ValueError, match="bf16 rounding 'half'.*'identity', 'nearest', 'bf16'"):
        conv.named_rounding("half")
    for net in (cifar8.NET, resnet34.NET):
        with pytest.raises(ValueError, match="bf16 rounding 'half'"):
            net.config(bf16=True, bf16_rounding="half")
        # a function passes through: the bf16 check's reference rounds with one of its own
        assert net.config(bf16=True, bf16_rounding=conv.round_bf16).bf16_rounding is conv.round_bf16
    with pytest.raises(ValueError, match="round_bf16: expected float32, float64 or bfloat16"):
        conv.round_bf16(jnp.ones(3, jnp.float16))
