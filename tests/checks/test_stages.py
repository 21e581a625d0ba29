"""Per-stage ties: each stage (cifar8: each of its seventeen layers) tied to the VJP of that piece
alone at the cotangent the rendered chain hands it; the first stage where a planted bug parts; the
head tied at any point; the chain from arbitrary loss cotangents; the sweep over N.

Kept quick: cifar8 at batch 2 (photos, drawn weights); ResNet-34 at 32 px, batch 2, K = 10 — the
degenerate point where layer4's BatchNorm normalises M = 2 values — compiled once per module.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import data, nets, prng
from gradtie.checks import bugs, census, check, stages
from gradtie.checks.tie import Point, compare, targets_matrix, zero_in_reals
from gradtie.nets import cifar8, resnet34

ALPHA = 0.1
N = 2
NET8, NET34 = cifar8.NET, resnet34.NET
CFG8 = cifar8.Config()
CFG34 = resnet34.Config(num_classes=10)
BOTTLENECK = str(Path(__file__).resolve().parents[2] / "examples" / "bottleneck.py") + ":NET"


def f64(params):
    return {k: jnp.asarray(np.asarray(v, np.float64)) for k, v in params.items()}


def photos(n=N, size=32):
    return jnp.asarray(data.photos(n, size, seed=0), jnp.float64)


def labels(n=N, k=10):
    return targets_matrix((jnp.arange(n) * 3 + 1) % k, k, jnp.float64)


@pytest.fixture(scope="module")
def params8():
    return f64(NET8.init(jax.random.key(0), CFG8, weights="drawn"))


@pytest.fixture(scope="module")
def params34():
    return f64(NET34.init(jax.random.key(0), CFG34, weights="drawn"))


@pytest.fixture(scope="module")
def rec8(params8):
    return stages.record(NET8, params8, photos(), CFG8, targets=labels(), label_smoothing=ALPHA)


@pytest.fixture(scope="module")
def stages8(params8, rec8):
    return stages.stage_ties(Point.of(NET8, params8, photos(), labels(), CFG8, label_smoothing=ALPHA), rec=rec8)


@pytest.fixture(scope="module")
def smooth_point8(params8):
    """randn images with every pool-feeding β lifted: no dead window, so MaxPool2Smooth holds."""
    x = prng.uniform(jax.random.key(3), (N, 3, 32, 32), jnp.float64)
    p = census.lift_dead_windows(NET8, params8, x, CFG8)
    return p, x, census.smoothness(NET8, p, x, CFG8)


@pytest.fixture(scope="module")
def stages34(params34):
    return stages.stage_ties(Point.of(NET34, params34, photos(), labels(), CFG34, label_smoothing=ALPHA))


# ---- the chain records what it hands each stage ---------------------------------------------------

def test_the_recorded_chain_is_the_nets_own(params8, rec8):
    """The tape holds what the chain handed each stage: the head gets dlogits, each stage's backward
    at its recorded input and cotangent returns the cotangent the stage below was handed, stage1's
    returns dx; the nodes are the net's own backward from the same dlogits."""
    logits, saved = NET8.forward(params8, photos(), CFG8)
    grads, dx = NET8.backward(params8, saved, rec8.dlogits, CFG8)
    assert list(rec8.grads) == list(params8)
    rows = compare(rec8.grads, grads, zero_nodes=zero_in_reals(params8), dx=(rec8.dx, dx))  # compiled apart
    assert all(r.rel <= 1e-13 for r in rows), max(rows, key=lambda r: r.rel)
    assert set(rec8.cotangents) == set(rec8.inputs) == {"head", "stage4", "stage3", "stage2", "stage1"}
    assert jnp.array_equal(rec8.cotangents["head"], rec8.dlogits)
    assert jnp.array_equal(rec8.inputs["stage1"], photos())
    below = {"head": "stage4", "stage4": "stage3", "stage3": "stage2", "stage2": "stage1"}
    for name in ("head", "stage4", "stage3", "stage2", "stage1"):
        _, handed_on = stages._stage_at(NET8, name, params8, rec8.inputs[name], rec8.cotangents[name], CFG8)
        want = rec8.cotangents[below[name]] if name in below else rec8.dx
        assert compare({"d": handed_on}, {"d": want})[0].rel <= 1e-13, name
        assert jnp.array_equal(rec8.handed_on(name), want)


def test_record_takes_targets_or_a_cotangent_not_both(params8):
    with pytest.raises(ValueError, match="not both"):
        stages.record(NET8, params8, photos(), CFG8)
    with pytest.raises(ValueError, match="shape"):
        stages.record(NET8, params8, photos(), CFG8, dlogits=jnp.zeros((N, 9)))
    with pytest.raises(ValueError, match="no finer stages"):
        stages.stage_ties(Point(NET34, CFG34, {}, photos(), None), level="layers")


# ---- cifar8: stages and the seventeen layers -------------------------------------------------------

def test_cifar8_every_stage_ties_to_its_vjp_alone(stages8):
    assert stages8.ok, stages8.summary()
    assert [t.net for t in stages8.ties] == ["stage1", "stage2", "stage3", "stage4", "head"]
    assert stages8.cotangent is not None and stages8.cotangent.tied
    assert sum(len(t.nodes) for t in stages8.ties) == 38
    assert stages8.first_parting() is None


def test_cifar8_seventeen_layers_tie_where_maxpool2smooth_holds(params8, smooth_point8):
    p, x, smooth = smooth_point8
    assert smooth.hypothesis(census.C8_INPUT).holds
    rep = stages.stage_ties(Point.of(NET8, p, x, labels(), CFG8, label_smoothing=ALPHA), level="layers")
    assert rep.ok and all(t.tied for t in rep.ties), rep.summary()
    assert len(rep.ties) == 17
    kinds = [t.meta["kind"] for t in rep.ties]
    assert (kinds.count("conv-bn-relu"), kinds.count("pool"), kinds.count("dense"), kinds.count("relu")) == (8, 4, 3, 2)
    assert len(rep.composition) == 38 + 5 and all(r.ok for r in rep.composition)


def test_a_pool_alone_parts_at_a_dead_window_beyond_maxpool2smooth(params8, rec8):
    """At photos the pools' dead windows tie their zeros: the pool alone has no derivative there
    (autodiff's max splits the tie, the render routes it to one cell), while every stage, whose ReLU
    kills those cells, still ties. The control the layer tie needs: it can fail."""
    smooth = census.smoothness(NET8, params8, photos(), CFG8)
    assert not smooth.hypothesis(census.C8_INPUT).holds and smooth.ok
    rep = stages.stage_ties(Point.of(NET8, params8, photos(), labels(), CFG8, label_smoothing=ALPHA), level="layers", rec=rec8)
    assert {t.net for t in rep.failed} == {"pool1", "pool2", "pool3", "pool4"}
    assert rep.first_parting().stage == "pool4"


@pytest.mark.parametrize("bug, stage", [("bn_forget_gamma", "stage4"), ("relu_mask_from_conv_output", "stage4"),
                                        ("head_no_batch_divisor", stages.LOSS_COTANGENT),
                                        ("dense_weight_grad_transposed", "head")])
def test_a_planted_bug_parts_at_its_stage(params8, bug, stage):
    parting = stages.stage_ties(Point.of(NET8, params8, photos(), labels(), CFG8, label_smoothing=ALPHA), chain=bugs.plant(bug, NET8)).first_parting()
    assert parting is not None and parting.stage == stage, parting


def test_a_stage_handed_a_wrong_cotangent_still_ties(params8):
    """The localisation: after a wrong head cotangent every stage is a correct VJP of what it is
    handed, so only the loss-cotangent row parts."""
    rep = stages.stage_ties(Point.of(NET8, params8, photos(), labels(), CFG8, label_smoothing=ALPHA), chain=bugs.plant("head_no_batch_divisor", NET8))
    assert all(t.tied for t in rep.ties) and not rep.cotangent.ok
    assert rep.first_parting().stage == stages.LOSS_COTANGENT


# ---- ResNet-34: eighteen stages at M = 2 ------------------------------------------------------------

def test_resnet34_eighteen_stages_tie_even_at_m2(stages34):
    assert stages34.ok and all(t.tied for t in stages34.ties) and stages34.first_parting() is None, stages34.summary()
    assert len(stages34.ties) == 18
    kinds = [t.meta["kind"] for t in stages34.ties]
    assert (kinds.count("stem"), kinds.count("identity"), kinds.count("downsample"), kinds.count("head")) == (1, 13, 3, 1)
    assert len(stages34.inputs("identity")) == 13 and len(stages34.inputs("downsample")) == 3
    assert all(r.agrees for r in stages34.inputs("identity") + stages34.inputs("downsample"))
    assert stages34["layer4.0"].row("layer4.0.bn1.weight").cells == 2


@pytest.mark.slow
def test_resnet34_projection_bug_parts_at_a_downsample_block(params34):
    parting = stages.stage_ties(Point.of(NET34, params34, photos(), labels(), CFG34, label_smoothing=ALPHA), chain=bugs.plant("projection_bn_reads_dn2", NET34)).first_parting()
    assert parting is not None and parting.stage == "layer4.0" and parting.kind == "downsample"


def test_head_ties_at_any_point(params34):
    """r34HeadBHasVJP is global: any GAP input (negative values, no point of the net) ties."""
    h = prng.normal(jax.random.key(7), (3, 512, 2, 2), jnp.float64)
    dy = prng.normal(jax.random.key(8), (3, 10), jnp.float64)
    rep = stages.tie_at(NET34, params34, "head", h, dy, CFG34)
    assert rep.tied and [r.name for r in rep.rows] == ["fc.weight", "fc.bias", "input"]
    grads, dx = stages._stage_at(NET34, "head", params34, h, dy, CFG34)
    wrong = stages.tie_at(NET34, params34, "head", h, dy, CFG34, rendered_side=(grads, 1.01 * dx))
    assert [r.name for r in wrong.failed] == ["input"]
    with pytest.raises(ValueError, match="stage"):
        stages.tie_at(NET34, params34, "layer9.0", h, dy, CFG34)


# ---- any loss cotangent ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["normal", "spike", "scaled"])
def test_the_chain_ties_at_any_loss_cotangent(params8, kind):
    d = stages.random_cotangent(jax.random.key(5), (N, 10), kind=kind)
    rep = stages.cotangent_tie(Point.of(NET8, params8, photos(), None, CFG8), d)
    assert rep.tied, rep.summary()
    assert len(rep.nodes) == 38 and rep.rows[-1].name == "input"


def test_a_wrong_cotangent_fails_the_cotangent_tie(params8):
    d = stages.random_cotangent(jax.random.key(5), (N, 10))
    rec = stages.record(NET8, params8, photos(), CFG8, dlogits=d)
    assert stages.cotangent_tie(Point.of(NET8, params8, photos(), None, CFG8), d, rec=rec).tied
    # the oracle reads the record's dlogits: a chain that ran from another one fails
    rep = stages.cotangent_tie(Point.of(NET8, params8, photos(), None, CFG8), d, rec=rec._replace(dlogits=2 * d))
    assert not rep.ok and len(rep.failed) >= 30


# ---- the check names the stage ----------------------------------------------------------------------

def test_check_names_the_first_parting_stage():
    rep = check.run_check("cifar8", batch=N, data="photos", plant_bug="bn_forget_gamma", finite_differences=False)
    assert rep.exit_code == check.EXIT_FAILED
    assert rep.parting is not None and rep.parting.stage == "stage4"
    assert "first differ at stage4" in rep.summary()
    assert rep.as_dict()["first_parting"]["stage"] == "stage4"


# ---- the sweep over N --------------------------------------------------------------------------------

@pytest.mark.slow
def test_sweep_ties_every_n_and_states_the_smallest(params8):
    sw = stages.sweep(NET8, params8, CFG8, lambda n: photos(n), [1, 2], label_smoothing=ALPHA)
    assert sw.ok and [r.n for r in sw.rows] == [1, 2]
    assert sw.smallest(census.PARAMETERS) == 1 and sw.below(census.PARAMETERS) is None
    assert sw.smallest(census.C8_INPUT) is None          # photos hold dead windows at every N
    assert "MaxPool2Smooth" in sw.below(census.C8_INPUT)
    assert all(0 < r.ratio <= 1 for r in sw.rows)


def test_sweep_reports_resnet_at_n1_and_32px_as_degenerate_never_tied():
    """At 32 px and N = 1 layer4's BatchNorm averages M = 1 value: the row is degenerate, carries no
    tie, counts neither as tied nor against `ok`, and stops the smallest N from reaching 1."""
    net, cfg = resnet34.NET, resnet34.Config(num_classes=10)
    params = {k: v.astype(jnp.float64) for k, v in net.init(jax.random.key(0), cfg, weights="drawn").items()}
    sw = stages.sweep(net, params, cfg, lambda n: photos(n), [1], label_smoothing=ALPHA)
    (row,) = sw.rows
    assert row.degenerate == ("layer4.0.bn1", 1) and row.tie is None and row.smooth.ok
    assert sw.ok and sw.smallest(census.PARAMETERS) is None
    assert "degenerate point: BatchNorm layer4.0.bn1" in sw.below(census.PARAMETERS) and "degenerate" in sw.table()


def test_sweep_refuses_a_batch_size_below_one(params8):
    with pytest.raises(ValueError, match="positive"):
        stages.sweep(NET8, params8, CFG8, photos, [0])


# ---- a net of your own ------------------------------------------------------------------------------

def test_a_net_of_your_own_parts_at_its_own_op():
    """The bottleneck net of examples/ (built from the public protocol, with a depthwise conv the
    kit lacks), its depthwise input backward planted with the kernel unflipped: every other stage
    ties to its VJP alone at the cotangent it is handed (the stem too, handed the wrong one), and
    the chain parts first at the depthwise stage, on its input cotangent only."""
    net = nets.load(BOTTLENECK)
    params = f64(net.init(jax.random.key(0), weights="drawn"))
    x = prng.normal(jax.random.key(1), (N, 3, 16, 16), jnp.float64)
    rep = stages.stage_ties(Point.of(net, params, x, labels(), net.config(), label_smoothing=ALPHA), chain=bugs.plant("depthwise_kernel_not_flipped", net))
    assert [t.net for t in rep.ties] == ["stem", "dw", "layer1.0", "layer2.0", "head"]
    assert rep.cotangent.tied and [t.net for t in rep.ties if not t.tied] == ["dw"], rep.summary()
    assert [r.name for r in rep["dw"].failed] == ["input"]
    parting = rep.first_parting()
    assert parting.stage == "dw" and parting.kind == "depthwise" and parting.row.name == "input"
