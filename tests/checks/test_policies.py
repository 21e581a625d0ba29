"""Every execution policy's chain tied on the CPU (`checks.policies`): bf16 stage by stage at the
chain's own rounding decisions, every conv site a bf16-out convolution equal to the suite's
float32-accumulate-then-round kind; tf32 within its envelope as measured here. Controls: planted
catalogue entries fail under each policy; a bf16-out convolution is compared bit for bit against
the kind; `gradtie check --policy` exits 0 on the real chain and 1 on a planted one. Drawn weights
(γ ≠ 1, β ≠ 0) on the shipped photos.
"""
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import cli, data, policy, prng
from gradtie.checks import policies
from gradtie.checks.bf16.gradient import Bf16Report
from gradtie.checks.check import EXIT_FAILED, EXIT_TIED, run_check
from gradtie.checks.tie import targets_matrix
from gradtie.nets import cifar8, resnet34
from gradtie.ops import conv

K = 10


def point(net, cfg, n, size):
    params = net.init(jax.random.key(0), replace(cfg, policy="tie"), weights="drawn")
    x = jnp.asarray(data.photos(n, size, seed=0), jnp.float32)
    t = targets_matrix(prng.randint(jax.random.key(1), (n,), 0, K), K, jnp.float32)
    return params, x, t


@pytest.fixture(scope="module")
def c8():
    return point(cifar8.NET, cifar8.Config(), 4, 32)


def test_bf16_policy_chain_ties_stage_by_stage_and_every_site_is_the_suites_kind(c8):
    params, x, t = c8
    cfg = cifar8.Config(policy="bf16")
    rep = policies.check(cifar8.NET, params, x, t, cfg, label_smoothing=0.1)
    assert isinstance(rep, Bf16Report) and rep.meta["policy"] == "bf16"
    # every conv node (forward with its bias, input backward, weight grad) = rnd(f32 node at
    # rounded operands), bit for bit: the bf16-out convolution is the suite's kind
    assert all(r.equal for r in rep.sites) and len(rep.sites) == 24
    assert rep.erasure.ok
    assert rep.ok and not rep.ill_conditioned, rep.summary()
    # limits a bf16-ulp bug can fail: every stage row is held to the float32 envelope, not to bf16's
    rows = [r for r in rep.rows if r.name != "input"]
    assert max(r.limit for r in rows) < 1e-3, max(rows, key=lambda r: r.limit)


def test_tf32_policy_ties_within_the_envelope_measured_where_it_runs(c8):
    params, x, t = c8
    rep = policies.check(cifar8.NET, params, x, t, cifar8.Config(policy="tf32"), label_smoothing=0.1)
    assert rep.ok and not rep.ill_conditioned, rep.summary()
    # a CPU has no TF32 units: the policy's contractions are float32 there, and measured so
    assert rep.meta["unit_roundoff"] == policy.unit_roundoff_here("tf32") == 2.0 ** -24
    assert policy.unit_roundoff_here("tf32", backend="gpu") == 2.0 ** -11
    assert policy.unit_roundoff_here("bf16") == 2.0 ** -8


@pytest.mark.parametrize("name", ["bf16", "tf32"])
def test_the_catalogue_is_caught_under_every_fast_policy(c8, name):
    params, x, t = c8
    entries = ["bn_unbiased_variance_backward", "conv_kernel_not_flipped", "head_smoothing_wrong_k"]
    caught = policies.caught(cifar8.NET, params, x, t, cifar8.Config(policy=name), label_smoothing=0.1,
                             names=entries)
    assert [c.bug for c in caught] == entries
    assert all(c.caught for c in caught), [(c.bug, c.where) for c in caught]


@pytest.mark.parametrize("stride,formulation", [(1, "conv"), (2, "conv"), (1, "patches"), (2, "patches")])
def test_a_bf16_out_convolution_is_the_float32_accumulate_then_round_kind_bit_for_bit(stride, formulation):
    """What the bf16 policy runs (bf16 operands, bf16 result from the contraction itself) against
    the suite's kind in a float32 chain (bf16-typed operands, float32 accumulation, one rounding)."""
    k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(k1, (2, 8, 12, 12), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k2, (16, 8, 3, 3), jnp.float32) / 8
    y, _ = conv.forward(x, w, stride=stride, formulation=formulation)
    kind, _ = conv.forward(x.astype(jnp.float32), w, stride=stride, rnd=conv.bf16_operand, formulation=formulation)
    assert y.dtype == jnp.bfloat16 and np.array_equal(np.asarray(y), np.asarray(kind.astype(jnp.bfloat16)))
    dy = jax.random.normal(k3, y.shape, jnp.float32).astype(jnp.bfloat16)
    dx = conv.backward(w, dy, input_shape=x.shape, stride=stride, formulation=formulation)
    dx_kind = conv.backward(w, dy.astype(jnp.float32), input_shape=x.shape, stride=stride, rnd=conv.bf16_operand,
                            formulation=formulation)
    assert dx.dtype == jnp.bfloat16
    dw = conv.grad_weight(x, dy, kernel_size=3, stride=stride, formulation=formulation)
    dw_kind = conv.grad_weight(x.astype(jnp.float32), dy.astype(jnp.float32), kernel_size=3, stride=stride,
                               rnd=conv.bf16_operand, formulation=formulation)
    if formulation == "conv":    # one contraction: rounded once, exactly as the kind
        assert np.array_equal(np.asarray(dx), np.asarray(dx_kind.astype(jnp.bfloat16)))
        assert np.array_equal(np.asarray(dw), np.asarray(dw_kind.astype(jnp.bfloat16)))
    else:   # one matrix product whose float32 sums may run in another order: one rounding apart
        for got, want in ((dx, dx_kind), (dw, dw_kind)):
            want = np.asarray(want, np.float64)
            err = np.abs(np.asarray(got, np.float64) - want)
            assert np.all(err <= 2.0 ** -8 * np.abs(want) + 2.0 ** -20 * np.max(np.abs(want)))
            assert np.mean(err == 0) > 0.99     # and almost everywhere the same bits
    # control: a float32 result (no rounding) is not the kind's
    y32 = conv.forward(x.astype(jnp.float32), w, stride=stride, formulation=formulation)[0]
    assert not np.array_equal(np.asarray(y32), np.asarray(y, np.float32))


def test_check_takes_the_policy_by_name_and_refuses_what_it_cannot_judge():
    with pytest.raises(ValueError, match="execution policy 'fp8'"):
        run_check("cifar8", batch=2, policy="fp8")
    with pytest.raises(ValueError, match="policy bf16 and replicas together"):
        run_check("cifar8", batch=4, policy="bf16", replicas=2)
    with pytest.raises(ValueError, match="tie"):
        run_check("cifar8", batch=2, bf16=True, policy="bf16")
    assert cli.POLICY_NAMES == policy.NAMES


def test_gradtie_check_policy_exits_0_on_the_chain_and_1_on_a_planted_bug(capsys):
    assert cli.main(["check", "--policy", "bf16", "--batch", "4"]) == EXIT_TIED
    assert "24/24 conv nodes = rnd(f32 node at rounded operands)" in capsys.readouterr().out
    assert cli.main(["check", "--policy", "tf32", "--batch", "4", "--plant-bug", "bn_rsqrt_twice"]) == EXIT_FAILED
    assert "under policy 'tf32'" in capsys.readouterr().out


@pytest.mark.slow
def test_resnet34_bf16_policy_ties_stage_by_stage():
    params, x, t = point(resnet34.NET, resnet34.Config(num_classes=K), 2, 32)
    rep = policies.check(resnet34.NET, params, x, t, resnet34.Config(num_classes=K, policy="bf16"), label_smoothing=0.1)
    assert all(r.equal for r in rep.sites) and rep.ok, rep.summary()


def test_gradtie_train_takes_the_policy_by_name_records_it_and_resumes_under_it(tmp_path):
    """A few bf16-policy steps of the rendered chain on digits: finite, float32 parameters, the
    policy in run.json, and --resume reads it back. Control: a float64 run refuses a fast policy."""
    import json

    from gradtie import train

    out = tmp_path / "run"
    args = ["train", "--net", "cifar8", "--head-width", "16", "--data", "digits", "--n-train", "32",
            "--n-test", "16", "--batch", "8", "--epochs", "2", "--policy", "bf16", "--out", str(out)]
    assert cli.main(args + ["--stop-after", "1"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["policy"] == "bf16"
    assert train.resume_arguments(out)["policy"] == "bf16"
    assert cli.main(["train", "--out", str(out), "--resume"]) == 0
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [1, 2] and all(np.isfinite(h["loss"]) for h in history)
    with pytest.raises(ValueError, match="--policy bf16 trains float32 parameters"):
        cli._train(cli.parser().parse_args(args[:-2] + ["--dtype", "float64", "--out", str(tmp_path / "x")]))
