"""checks.step: the rendered train step tied to optax on autodiff gradients, and its controls going red."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import data
from gradtie.checks import step
from gradtie.nets import cifar8, resnet34
from gradtie.nets.protocol import Net

C8 = cifar8.Config(num_classes=7, head_width=64)
# the chapter shows these cases (Training with the rendered step): they run with `make test-all`
SLOW = pytest.mark.slow


def c8_params(seed=0, weights="drawn"):
    return cifar8.NET.init(jax.random.key(seed), C8, weights=weights)


@pytest.fixture(scope="module")
def c8_batches():
    return data.photo_batches(2, 4, 32, seed=0)


@pytest.fixture(scope="module")
def c8_reference(c8_batches):
    """One reference run per recipe, shared by its tie and its controls."""
    cache = {}

    def get(recipe):
        if recipe not in cache:
            cache[recipe] = step.reference_run(cifar8.NET, c8_params(), c8_batches, C8, recipe=recipe)
        return cache[recipe]
    return get


# ---- the update rules ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
@pytest.mark.parametrize("recipe", step.RECIPES)
def test_optax_recipe_equals_our_rule_bit_for_bit(recipe, dtype):
    params = {k: v.astype(dtype) for k, v in c8_params().items()}
    grads = step.random_gradients(params, 3, seed=1)
    assert step.rule_difference(recipe, params, grads) == 0.0


RULE_CONTROLS = [("heavy-ball", "decoupled_weight_decay"), ("heavy-ball", "dampened_momentum"),
                 ("nesterov", "no_lookahead"), ("nesterov", "dampened_momentum"),
                 ("sgd", "learning_rate_twice"), ("heavy-ball", "skip_tensor")]


@pytest.mark.parametrize("recipe,name", RULE_CONTROLS)
def test_rule_controls_part_from_optax(recipe, name):
    params = {k: v.astype(jnp.float64) for k, v in c8_params().items()}
    grads = step.random_gradients(params, 2, seed=1)
    control = step.control(cifar8.NET, recipe, name)
    assert step.rule_difference(recipe, params, grads, optimizer=control.optimizer) > 0.0


# ---- cifar8: the tie and every control -------------------------------------------------------------

@pytest.mark.parametrize("recipe", [pytest.param(r, marks=[SLOW] if r == "nesterov" else []) for r in step.RECIPES])
def test_cifar8_step_tied_to_optax_f64(recipe, c8_reference, c8_batches):
    rep = step.tie_step(cifar8.NET, c8_params(), c8_batches, C8, recipe=recipe, reference=c8_reference(recipe))
    assert rep.ok and not rep.ill_conditioned, rep.summary()
    assert rep.tensors == 38 and len(rep.steps) == 2
    # the 8 conv biases behind BatchNorm move only by weight decay (gradient 0 in ℝ)
    assert rep.movers == (38 if recipe == "heavy-ball" else 30)
    for s in rep.steps:
        assert s.moved == rep.movers
        assert s.within("params") == (38, 38)
        assert s.within("running") == (16, 16)
        assert s.within("momentum") == ((0, 0) if recipe == "sgd" else (38, 38))
    # the momentum state is part of what is tied: the rows exist and carry an envelope
    if recipe != "sgd":
        assert max(r.envelope for r in rep.steps[1].groups["momentum"]) > 0


def test_cifar8_step_tied_at_init_weights_and_another_seed(c8_batches):
    """γ = 1, β = 0 and zero conv biases (which stay 0 in ℝ), and a second draw: green at both."""
    for params in (c8_params(weights="init"), c8_params(seed=3)):
        rep = step.tie_step(cifar8.NET, params, c8_batches, C8, recipe="nesterov")
        assert rep.ok and not rep.ill_conditioned, rep.summary()


def test_decoupled_weight_decay_passes_step_1_weights_and_fails_the_buffer(c8_reference, c8_batches):
    """In ℝ the first step of decoupled decay is the coupled one: only the buffer tells, until step 2."""
    rep = step.tie_step(cifar8.NET, c8_params(), c8_batches, C8, recipe="heavy-ball",
                        reference=c8_reference("heavy-ball"),
                        control=step.control(cifar8.NET, "heavy-ball", "decoupled_weight_decay"))
    assert rep.red
    first, second = rep.steps
    assert first.within("params") == (38, 38)
    assert first.within("momentum")[0] < 38
    assert second.within("params")[0] < 38
    assert rep.first_failure()[:2] == (1, "momentum")


def test_skip_tensor_fails_exactly_that_tensor_at_step_1(c8_reference, c8_batches):
    control = step.control(cifar8.NET, "heavy-ball", "skip_tensor", skip="bn5.bias")
    rep = step.tie_step(cifar8.NET, c8_params(), c8_batches, C8, recipe="heavy-ball",
                        reference=c8_reference("heavy-ball"), control=control)
    first = rep.steps[0]
    assert first.moved == 37
    assert [r.name for r in first.groups["params"] if not r.ok] == ["bn5.bias"]
    assert [r.name for r in first.groups["momentum"] if not r.ok] == ["bn5.bias"]
    assert rep.red


def test_unbiased_running_variance_is_a_net_whose_batch_variances_are_unbiased(c8_batches):
    control = step.control(cifar8.NET, "nesterov", "unbiased_running_variance")
    assert isinstance(control.net, Net) and control.net is not cifar8.NET
    assert control.net.stage_list is cifar8.NET.stage_list and control.net.name == "cifar8"
    x = jnp.asarray(c8_batches[0][0])
    params = c8_params()
    _, saved = cifar8.NET.forward(params, x, C8)
    real, unbiased = cifar8.NET.batch_stats(saved), control.net.batch_stats(saved)
    m = 4 * 4 * 4                                     # bn7: N = 4 images of 4×4 cells
    np.testing.assert_allclose(unbiased["bn7.running_var"], real["bn7.running_var"] * m / (m - 1), rtol=1e-15)
    np.testing.assert_array_equal(unbiased["bn7.running_mean"], real["bn7.running_mean"])


def test_unbiased_running_variance_fails_only_the_variances(c8_reference, c8_batches):
    rep = step.tie_step(cifar8.NET, c8_params(), c8_batches, C8, recipe="nesterov",
                        reference=c8_reference("nesterov"),
                        control=step.control(cifar8.NET, "nesterov", "unbiased_running_variance"))
    for s in rep.steps:
        assert s.within("params") == (38, 38) and s.within("momentum") == (38, 38)
        failed = {r.name for r in s.groups["running"] if not r.ok}
        assert failed == {f"bn{k}.running_var" for k in range(1, 9)}
    assert rep.red


@pytest.mark.parametrize("recipe,name", [("heavy-ball", "dampened_momentum"), ("heavy-ball", "learning_rate_twice"),
                                         pytest.param("nesterov", "no_lookahead", marks=SLOW),
                                         ("sgd", "learning_rate_twice")])
def test_update_rule_controls_go_red_at_step_1(recipe, name, c8_reference, c8_batches):
    rep = step.tie_step(cifar8.NET, c8_params(), c8_batches, C8, recipe=recipe, reference=c8_reference(recipe),
                        control=step.control(cifar8.NET, recipe, name))
    assert rep.red and rep.first_failure()[0] == 1
    assert rep.steps[0].within("params")[0] < 38


# ---- ResNet-34: the 110- and 146-tensor steps ------------------------------------------------------

@SLOW
@pytest.mark.parametrize("conv_bias,recipe,tensors", [(False, "sgd", 110), (True, "heavy-ball", 146)])
def test_resnet34_step_tied_to_optax_f64(conv_bias, recipe, tensors):
    cfg = resnet34.Config(num_classes=7, conv_bias=conv_bias)
    params = resnet34.NET.init(jax.random.key(0), cfg, weights="drawn")
    batches = data.photo_batches(2, 4, 32, seed=1)
    rep = step.tie_step(resnet34.NET, params, batches, cfg, recipe=recipe)
    assert rep.tensors == tensors and rep.label_smoothing == 0.1
    assert rep.ok and not rep.ill_conditioned, rep.summary()
    assert rep.movers == tensors and all(s.moved == tensors for s in rep.steps)
    assert len(rep.steps[0].groups["running"]) == 72         # 36 BatchNorm layers
    # layer4 averages 4 cells per channel: the point's envelope, not the floor, sets some limits there
    assert any(r.by == "envelope" for _, _, r in rep.rows())


# ---- the reference and bad input -----------------------------------------------------------------

def test_reference_running_statistics_follow_spec():
    """Copied on step 0, then 0.99·old + 0.01·batch, biased variance over (n, h, w)."""
    rng = np.random.default_rng(0)
    c = rng.standard_normal((3, 2, 4, 5))
    running = {"bn.running_mean": np.full(2, 0.5), "bn.running_var": np.full(2, 2.0)}
    mean, var = c.mean(axis=(0, 2, 3)), c.var(axis=(0, 2, 3))
    first = step._reference_running(running, {"bn": jnp.asarray(c)}, jnp.asarray(0), per_example=False)
    later = step._reference_running(running, {"bn": jnp.asarray(c)}, jnp.asarray(1), per_example=False)
    np.testing.assert_allclose(first["bn.running_mean"], mean, rtol=1e-14)
    np.testing.assert_allclose(first["bn.running_var"], var, rtol=1e-14)
    np.testing.assert_allclose(later["bn.running_var"], 0.99 * 2.0 + 0.01 * var, rtol=1e-14)
    assert not np.allclose(later["bn.running_var"], 0.99 * 2.0 + 0.01 * c.var(axis=(0, 2, 3), ddof=1))


def test_bad_input_is_a_clear_error(c8_reference, c8_batches):
    with pytest.raises(ValueError, match="recipe 'adamw'"):
        step.optax_recipe("adamw", 1e-3)
    with pytest.raises(ValueError, match="at least one"):
        step.reference_run(cifar8.NET, c8_params(), [], C8)
    with pytest.raises(ValueError, match="bf16"):
        step.reference_run(cifar8.NET, c8_params(), c8_batches, cifar8.Config(num_classes=7, head_width=64, bf16=True))
    with pytest.raises(ValueError, match="targets"):
        step.reference_run(cifar8.NET, c8_params(), [(c8_batches[0][0], np.zeros((4, 3)))], C8)
    with pytest.raises(ValueError, match="expected one of"):
        step.control(cifar8.NET, "sgd", "decoupled_weight_decay")
    with pytest.raises(ValueError, match="shared reference"):
        step.tie_step(cifar8.NET, c8_params(), c8_batches, C8, recipe="sgd", reference=c8_reference("nesterov"))
    with pytest.raises(ValueError, match="shared reference"):      # the rule's lr or α is not the reference's
        step.tie_step(cifar8.NET, c8_params(), c8_batches, C8, recipe=step.Recipe("nesterov", lr=0.5),
                      reference=c8_reference("nesterov"))
    with pytest.raises(ValueError, match="shared reference"):
        step.tie_step(cifar8.NET, c8_params(), c8_batches, C8, recipe=step.Recipe("nesterov", label_smoothing=0.3),
                      reference=c8_reference("nesterov"))
    with pytest.raises(ValueError, match="lr must be positive"):
        step.reference_run(cifar8.NET, c8_params(), c8_batches, C8, recipe=step.Recipe("nesterov", lr=-1.0))
