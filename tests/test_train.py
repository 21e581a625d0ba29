"""gradtie.train: update rules against optax, the schedule, the train step, running stats, fit."""

import json
from dataclasses import dataclass, replace
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gradtie import data, prng, train
from gradtie.checks import bugs
from gradtie.nets import cifar8, layers, protocol
from gradtie.nets.protocol import Net, ParamSpec, Pass, Stage
from gradtie.ops import batchnorm, dense, maxpool

OPTAX_TOL = 1e-12     # float64: the two sides differ only in the order of a few roundings
TIE_TOL = 1e-10       # float64 relative error, rendered step vs autodiff step (the float64 floor)


# ---- update rules against optax ------------------------------------------------------------------

def random_tree(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"conv1.weight": prng.normal(k1, (4, 3, 3, 3), jnp.float64),
            "bn1.weight": 1 + 0.1 * prng.normal(k2, (4,), jnp.float64),
            "fc.bias": prng.normal(k3, (5,), jnp.float64)}


def run_ours(opt, lr, steps=5, seed=0):
    params = random_tree(jax.random.key(seed))
    state = opt.init(params)
    trail = []
    for t in range(steps):
        grads = random_tree(jax.random.key(100 + t))
        params, state = opt.update(params, grads, state, lr)
        trail.append(params)
    return trail


def run_optax(tx, steps=5, seed=0):
    params = random_tree(jax.random.key(seed))
    state = tx.init(params)
    trail = []
    for t in range(steps):
        grads = random_tree(jax.random.key(100 + t))
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        trail.append(params)
    return trail


def worst_rel_err(trail_a, trail_b):
    return max(float(jnp.max(jnp.abs(a[k] - b[k])) / jnp.max(jnp.abs(b[k])))
               for a, b in zip(trail_a, trail_b) for k in b)


LR = 0.05
PAIRS = {
    "sgd": lambda: (train.sgd(), optax.sgd(LR)),
    "nesterov": lambda: (train.nesterov(), optax.sgd(LR, momentum=0.9, nesterov=True)),
    "heavy-ball": lambda: (train.heavy_ball(weight_decay=1e-2),
                           optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(LR, momentum=0.9))),
    "adamw": lambda: (train.adamw(weight_decay=1e-2),
                      optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-2)),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_update_rule_equals_optax_over_five_steps_f64(name):
    ours, theirs = PAIRS[name]()
    assert ours.name == name and set(train.OPTIMIZERS) == set(PAIRS)
    err = worst_rel_err(run_ours(ours, LR), run_optax(theirs))
    assert err <= OPTAX_TOL, err


def adam_without_bias_correction(b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-2):
    def update(params, grads, state, lr):
        m = {k: b1 * state["m"][k] + (1 - b1) * grads[k] for k in params}
        v = {k: b2 * state["v"][k] + (1 - b2) * grads[k] ** 2 for k in params}
        new = {k: params[k] - lr * (m[k] / (jnp.sqrt(v[k]) + eps) + weight_decay * params[k]) for k in params}
        return new, {"m": m, "v": v, "count": state["count"] + 1}
    return train.Optimizer("adamw-no-correction", train.adamw().init, update, {})


@pytest.mark.parametrize("ours, theirs", [
    (lambda: train.nesterov(momentum=0.8), lambda: optax.sgd(LR, momentum=0.9, nesterov=True)),
    (lambda: train.nesterov(), lambda: optax.sgd(LR, momentum=0.9)),                # plain momentum
    (lambda: train.heavy_ball(weight_decay=0.0),
     lambda: optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(LR, momentum=0.9))),
    (adam_without_bias_correction, lambda: optax.adamw(LR, weight_decay=1e-2)),
], ids=["wrong-momentum", "nesterov-vs-plain", "missing-weight-decay", "missing-bias-correction"])
def test_optax_comparison_control_goes_red(ours, theirs):
    assert worst_rel_err(run_ours(ours(), LR), run_optax(theirs())) > 1e-6


def test_make_optimizer_rejects_unknown_names():
    assert train.make_optimizer("adamw", weight_decay=0.0).hyper["weight_decay"] == 0.0
    with pytest.raises(ValueError, match="expected one of sgd, nesterov, heavy-ball, adamw"):
        train.make_optimizer("lamb")


# ---- schedule ------------------------------------------------------------------------------------

def test_cosine_warmup_shape_and_optax_tail():
    sched = train.cosine_warmup(0.1, 5, 25)
    lrs = np.array([float(sched(s)) for s in range(30)])
    np.testing.assert_allclose(lrs[:5], 0.1 * np.arange(1, 6) / 5, rtol=1e-12)
    assert lrs[5] == pytest.approx(0.1) and np.all(np.diff(lrs[5:26]) < 0) and np.all(lrs[25:] == 0)
    tail = optax.cosine_decay_schedule(0.1, 20)
    np.testing.assert_allclose(lrs[5:26], [float(tail(s)) for s in range(21)], rtol=1e-12, atol=1e-15)
    assert float(train.cosine_warmup(0.1, 0, 10)(0)) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="warmup_steps"):
        train.cosine_warmup(0.1, 11, 10)


# ---- a tiny net built from the public protocol: BN on the images (batch statistics) → flatten → dense ----

@dataclass(frozen=True)
class TinyConfig(protocol.Config):
    num_classes: int = 3


def _bn_forward(params, x, cfg, how: Pass):
    gamma, beta = params["bn1.weight"], params["bn1.bias"]
    if how.running is not None:
        rm, rv = how.running["bn1.running_mean"], how.running["bn1.running_var"]
        return layers.bn_eval(x, gamma, beta, rm, rv, cfg.eps), layers.ConvBNSaved(x, x, rm, rv)
    y, bn = batchnorm.forward(x, gamma, beta, eps=cfg.eps)
    return y, layers.ConvBNSaved(x, x, bn.mean, bn.var)


def _bn_backward(params, s, dy, cfg, kit):
    bn = layers.bn_saved(s, cfg)
    return layers.bn_nodes(kit, params, "bn1", bn, dy), layers.bn_input(kit, params, "bn1", bn, dy)


def _fc_forward(params, x, cfg, how: Pass):
    h = x.reshape(x.shape[0], -1)
    return dense.forward(h, params["fc.weight"], params["fc.bias"])[0], h


def _fc_backward(params, h, dlogits, cfg, kit):
    dh = kit.dense_backward("fc", params["fc.weight"], dlogits)
    return layers.dense_nodes(kit, "fc", h, dlogits), dh.reshape(h.shape[0], 3, 4, 4)


_TINY_STAGES = [Stage("bn", "bn", _bn_forward, _bn_backward, ("bn1.weight", "bn1.bias"),
                      bn_layers=lambda s: {"bn1": s}),
                Stage("head", "head", _fc_forward, _fc_backward, ("fc.weight", "fc.bias"))]
tiny = Net("tiny", TinyConfig, lambda cfg: layers.bn_specs("bn1", 3) + layers.dense_specs("fc", 48, cfg.num_classes),
           lambda cfg: _TINY_STAGES, size_rule="4", size_ok=lambda s: s == 4, default_size=4)
TINY = TinyConfig()


def tiny_batch(n=8, seed=0, dtype=jnp.float64):
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = 2.0 + 3.0 * prng.normal(k1, (n, 3, 4, 4), dtype)
    return x, prng.randint(k2, (n,), 0, TINY.num_classes)


def tiny_state(opt, dtype=jnp.float64):
    params = {k: v.astype(dtype) for k, v in tiny.init(jax.random.key(1), TINY).items()}
    return train.init_state(tiny, TINY, params, opt)


def rel_err(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-300))


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_rendered_step_equals_autodiff_step_on_the_stand_in_f64(name):
    opt = train.make_optimizer(name)
    x, labels = tiny_batch()
    targets = data.one_hot(labels, TINY.num_classes, jnp.float64)
    states = {}
    for grads in ("rendered", "autodiff"):
        step = train.make_step(tiny, TINY, opt, grads=grads, label_smoothing=0.1)
        s, m = step(tiny_state(opt), x, targets, 0.05)
        s, m = step(s, x, targets, 0.05)
        states[grads] = (s, m)
    (a, ma), (b, mb) = states["rendered"], states["autodiff"]
    for k in a.params:
        assert rel_err(a.params[k], b.params[k]) <= TIE_TOL, k
    assert float(ma["loss"]) == pytest.approx(float(mb["loss"]), rel=TIE_TOL)


def test_running_stats_first_step_copies_then_ema():
    opt = train.sgd()
    step = train.make_step(tiny, TINY, opt)
    x0, y0 = tiny_batch(seed=0)
    x1, y1 = tiny_batch(seed=1)
    s0 = tiny_state(opt)
    s1, _ = step(s0, x0, y0, 0.1)
    mean0 = jnp.mean(x0, axis=(0, 2, 3))
    var0 = jnp.var(x0, axis=(0, 2, 3))                        # biased, as BN normalises with
    np.testing.assert_allclose(s1.running["bn1.running_mean"], mean0, rtol=1e-13)
    np.testing.assert_allclose(s1.running["bn1.running_var"], var0, rtol=1e-13)
    s2, _ = step(s1, x1, y1, 0.1)
    np.testing.assert_allclose(s2.running["bn1.running_mean"],
                               0.99 * mean0 + 0.01 * jnp.mean(x1, axis=(0, 2, 3)), rtol=1e-13)
    np.testing.assert_allclose(s2.running["bn1.running_var"],
                               0.99 * var0 + 0.01 * jnp.var(x1, axis=(0, 2, 3)), rtol=1e-13)
    assert int(s2.step) == 2
    # the control: without the first-step copy the mean would sit near the initial zeros
    assert float(jnp.max(jnp.abs(0.01 * mean0 - s1.running["bn1.running_mean"]))) > 0.5


def test_step_takes_labels_or_rows_and_reports_metrics():
    opt = train.nesterov()
    step = train.make_step(tiny, TINY, opt)
    x, labels = tiny_batch()
    a, ma = step(tiny_state(opt), x, labels, 0.1)
    b, mb = step(tiny_state(opt), x, data.one_hot(labels, 3, jnp.float64), 0.1)
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k])
    assert set(ma) == {"loss", "accuracy", "grad_norm", "lr"} and 0 <= float(ma["accuracy"]) <= 1
    assert list(a.params) == list(tiny_state(opt).params)            # signature order survives jit
    assert list(a.opt_state["v"]) == list(a.params)
    with pytest.raises(ValueError, match="'rendered' or 'autodiff'"):
        train.make_step(tiny, TINY, opt, grads="finite-differences")


def test_loss_decreases_over_rendered_steps():
    opt = train.sgd()
    step = train.make_step(tiny, TINY, opt)
    x, labels = tiny_batch(n=16)
    s, losses = tiny_state(opt), []
    for _ in range(20):
        s, m = step(s, x, labels, 0.5)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.5 * losses[0]
    assert train.evaluate(tiny, TINY, s, np.asarray(x), np.asarray(labels), batch=5) >= 0.5


# ---- fit: precise BN, the run contract, resume -------------------------------------------------

def tiny_split(seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((3, 3, 4, 4))
    y = rng.integers(0, 3, 60)
    x = centres[y] + 0.5 * rng.standard_normal((60, 3, 4, 4))
    return data.Split(x[:48].astype(np.float32), y[:48], x[48:].astype(np.float32), y[48:])


FIT = train.FitConfig(optimizer="nesterov", lr=0.05, batch=8, schedule="cosine", warmup_epochs=1, flip=True,
                      mix="mixup", seed=3, precise_batches=4)
STEPS_PER_EPOCH = 48 // 8
CONTRACT = {"epoch", "step", "loss", "train_accuracy", "test_accuracy", "test_accuracy_running", "lr",
            "seconds", "images_per_second"}
TIMINGS = train.WALL_CLOCK          # the wall-clock fields, the step's and the whole loop's
assert {"seconds", "eval_seconds", "images_per_second"} <= TIMINGS


def trajectory(history):
    """A history without its wall-clock fields: what must repeat bit for bit."""
    return [{k: v for k, v in h.items() if k not in TIMINGS} for h in history]


def assert_same_state(a, b):
    for part in ("params", "running"):
        for k in getattr(b, part):
            np.testing.assert_array_equal(getattr(a, part)[k], getattr(b, part)[k], err_msg=f"{part}/{k}")
    for name, tree in b.opt_state.items():
        for k in tree:
            np.testing.assert_array_equal(a.opt_state[name][k], tree[k], err_msg=f"opt_state/{name}/{k}")
    assert int(a.step) == int(b.step)


def test_precise_statistics_are_the_population_statistics_of_the_fixed_batches():
    # the stand-in's BN reads the images themselves, so its population statistics are the images'
    x = tiny_split().x_train
    params = tiny.init(jax.random.key(0), TINY)
    got = train.precise_statistics(tiny, TINY, params, x, batch=8, batches=4, seed=5)
    order = np.asarray(jax.random.permutation(jax.random.fold_in(jax.random.key(5), train._PRECISE_STREAM), 48))
    used = x[order[:32]].astype(np.float64)
    np.testing.assert_allclose(got["bn1.running_mean"], used.mean(axis=(0, 2, 3)), rtol=1e-5)
    np.testing.assert_allclose(got["bn1.running_var"], used.var(axis=(0, 2, 3)), rtol=1e-5)
    # the control: the mean of the batch variances alone (no spread of the batch means) is smaller
    per_batch = used.reshape(4, 8, 3, 4, 4)
    naive = per_batch.var(axis=(1, 3, 4)).mean(axis=0)
    assert np.all(naive < 0.999 * used.var(axis=(0, 2, 3)))
    # a different set of batches gives different statistics: the set is fixed by the seed
    other = train.precise_statistics(tiny, TINY, params, x, batch=8, batches=4, seed=6)
    assert not np.array_equal(other["bn1.running_mean"], got["bn1.running_mean"])
    with pytest.raises(ValueError, match="no full batch of 64"):
        train.precise_statistics(tiny, TINY, params, x, batch=64)


def test_evaluate_reads_the_statistics_it_is_given():
    split = tiny_split()
    result = train.fit(tiny, TINY, split, replace(FIT, epochs=2))
    state, precise = result.state, result.precise
    acc = train.evaluate(tiny, TINY, state, split.x_test, split.y_test, batch=5, running=precise)
    assert acc == result.history[-1]["test_accuracy"]                       # padding changes nothing
    assert train.evaluate(tiny, TINY, state, split.x_test, split.y_test) == acc
    assert train.evaluate(tiny, TINY, state, split.x_test, split.y_test) == acc
    assert result.history[-1]["test_accuracy_running"] == train.evaluate(tiny, TINY, state, split.x_test, split.y_test,
                                                                         running=state.running)
    # the control: statistics shifted by 3 standard deviations wreck the accuracy
    bad = {k: (v + 3 * jnp.sqrt(precise["bn1.running_var"]) if k.endswith("mean") else v)
           for k, v in precise.items()}
    assert train.evaluate(tiny, TINY, state, split.x_test, split.y_test, running=bad) < acc - 0.2


def test_fit_writes_the_run_contract(tmp_path):
    result = train.fit(tiny, TINY, tiny_split(), replace(FIT, epochs=3), out=tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    rows = [json.loads(line) for line in lines]
    assert [r["epoch"] for r in rows] == [1, 2, 3] and [r["step"] for r in rows] == [6, 12, 18]
    for r in rows:
        assert CONTRACT <= set(r)
        assert r["bn_gap"] == r["test_accuracy"] - r["test_accuracy_running"]
        assert r["seconds"] > 0 and r["images_per_second"] > 0
    assert rows == result.history
    assert rows[-1]["test_accuracy"] >= 0.75
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["epochs"] == 3 and run["optimizer"] == "nesterov" and run["batch"] == 8
    assert run["segments"] == [{"first": 0, "steps": 18, "lr": 0.05, "warmup_steps": 6}]
    assert run["data"]["n_train"] == 48 and len(run["data"]["fingerprint"]) == 16
    assert run["running_momentum"] == 0.01 and run["precise_batches"] == 4
    state, meta = train.load_checkpoint(tmp_path, result.state)
    assert_same_state(state, result.state)
    assert meta["history"] == rows
    assert not list(tmp_path.glob("*.tmp"))
    # a second run into the same folder would mix two runs: an error, unless it resumes
    with pytest.raises(ValueError, match="already holds a run"):
        train.fit(tiny, TINY, tiny_split(), replace(FIT, epochs=3), out=tmp_path)
    with pytest.raises(FileNotFoundError, match="no run to resume"):
        train.fit(tiny, TINY, tiny_split(), replace(FIT, epochs=3), out=tmp_path / "new", resume=True)


def test_interrupted_after_epoch_2_and_resumed_equals_uninterrupted_bit_for_bit(tmp_path):
    straight = train.fit(tiny, TINY, tiny_split(), replace(FIT, epochs=4), out=tmp_path / "a")
    first = train.fit(tiny, TINY, tiny_split(), replace(FIT, epochs=4), stop_after=2, out=tmp_path / "b")
    assert len(first.history) == 2
    assert len((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()) == 2
    resumed = train.fit(tiny, TINY, tiny_split(), FIT, out=tmp_path / "b", resume=True)   # epochs: 4 from run.json
    assert_same_state(resumed.state, straight.state)
    assert trajectory(resumed.history) == trajectory(straight.history)
    assert len((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()) == 4
    # the control: a different seed is a different run, not the same one
    other = train.fit(tiny, TINY, tiny_split(), replace(FIT, epochs=4, seed=4), out=tmp_path / "c")
    assert not np.array_equal(other.state.params["fc.weight"], straight.state.params["fc.weight"])


def interrupting(monkeypatch, at_step, exc):
    """make_step whose step raises `exc` instead of taking step `at_step` (1-based)."""
    real = train.make_step

    def make_step(*args, **kwargs):
        step = real(*args, **kwargs)

        def wrapped(state, x, targets, lr):
            if int(state.step) + 1 == at_step:
                raise exc
            return step(state, x, targets, lr)
        return wrapped

    monkeypatch.setattr(train, "make_step", make_step)


def test_ctrl_c_mid_epoch_saves_a_checkpoint_and_the_run_resumes_exactly(tmp_path, monkeypatch):
    straight = train.fit(tiny, TINY, tiny_split(), replace(FIT, epochs=3), out=tmp_path / "a")
    with monkeypatch.context() as m:
        interrupting(m, at_step=STEPS_PER_EPOCH + 4, exc=KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            train.fit(tiny, TINY, tiny_split(), replace(FIT, epochs=3), out=tmp_path / "b")
    state, meta = train.load_checkpoint(tmp_path / "b", straight.state)
    assert int(state.step) == STEPS_PER_EPOCH + 3 and len(meta["history"]) == 1
    resumed = train.fit(tiny, TINY, tiny_split(), FIT, out=tmp_path / "b", resume=True)
    assert_same_state(resumed.state, straight.state)
    assert trajectory(resumed.history) == trajectory(straight.history)


def test_resume_keeps_the_schedule_and_extends_only_when_asked(tmp_path):
    train.fit(tiny, TINY, tiny_split(), replace(FIT, epochs=2), out=tmp_path)
    with pytest.raises(ValueError, match="fixed by its total of 2 epochs.*extend"):
        train.fit(tiny, TINY, tiny_split(), replace(FIT, epochs=3), out=tmp_path, resume=True)
    with pytest.raises(ValueError, match="optimizer='nesterov', this call asks for 'adamw'"):
        train.fit(tiny, TINY, tiny_split(), replace(FIT, optimizer="adamw"), out=tmp_path, resume=True)
    with pytest.raises(ValueError, match="fingerprint"):
        train.fit(tiny, TINY, tiny_split(seed=1), FIT, out=tmp_path, resume=True)
    with pytest.raises(ValueError, match="extend_epochs extends a run being resumed"):
        train.fit(tiny, TINY, tiny_split(), FIT, out=tmp_path / "x", extend_epochs=1)
    longer = train.fit(tiny, TINY, tiny_split(), FIT, out=tmp_path, resume=True, extend_epochs=1)
    assert [h["epoch"] for h in longer.history] == [1, 2, 3]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["epochs"] == 3 and run["segments"][1] == {"first": 12, "steps": 6, "lr": 0.05, "warmup_steps": 0}
    # the first two epochs kept their schedule; the third is a new cosine cycle from the base rate
    assert longer.history[1]["lr"] < 0.01 and longer.history[2]["lr"] < 0.01
    sched = train._segments_schedule("cosine", run["segments"])
    assert float(sched(11)) < 0.01 and float(sched(12)) == pytest.approx(0.05)


def test_metrics_log_is_reconciled_with_the_checkpoint_on_resume(tmp_path):
    train.fit(tiny, TINY, tiny_split(), replace(FIT, epochs=3), stop_after=1, out=tmp_path)
    log = tmp_path / "metrics.jsonl"
    log.write_text(log.read_text() + '{"epoch": 2, "written after the last checkpoint": true}\n')
    train.fit(tiny, TINY, tiny_split(), FIT, stop_after=2, out=tmp_path, resume=True)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2] and all(CONTRACT <= set(r) for r in rows)


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    train.fit(tiny, TINY, tiny_split(), replace(FIT, epochs=3), stop_after=1, out=tmp_path)
    before = (tmp_path / "checkpoint.npz").read_bytes()
    real = train.make_step

    def make_step(*args, **kwargs):
        step = real(*args, **kwargs)

        def poisoned(state, x, targets, lr):
            new, metrics = step(state, x, targets, lr)
            if int(new.step) == STEPS_PER_EPOCH + 2:
                metrics = {**metrics, "loss": jnp.asarray(jnp.nan)}
            return new, metrics
        return poisoned

    monkeypatch.setattr(train, "make_step", make_step)
    with pytest.raises(train.NonFiniteLoss, match=rf"loss is nan .* at step {STEPS_PER_EPOCH + 2} "
                                                  r"\(epoch 2, batch 2 of 6.*checkpoint.npz.*step 6\) is kept"):
        train.fit(tiny, TINY, tiny_split(), FIT, out=tmp_path, resume=True)
    assert (tmp_path / "checkpoint.npz").read_bytes() == before
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_real_divergence_is_caught_too(tmp_path):
    with pytest.raises(train.NonFiniteLoss, match="at step .* no checkpoint was written"):
        train.fit(tiny, TINY, tiny_split(), replace(FIT, epochs=1, optimizer="sgd", lr=1e30), out=tmp_path)


def test_corrupt_or_mismatched_checkpoint_is_a_one_line_error_naming_file_and_tensor(tmp_path):
    result = train.fit(tiny, TINY, tiny_split(), replace(FIT, epochs=1, mix=None), out=tmp_path)
    file = tmp_path / "checkpoint.npz"
    other_opt = train.init_state(tiny, TINY, result.state.params, train.adamw())
    with pytest.raises(ValueError, match=r"checkpoint\.npz.*first mismatching tensor 'opt_state/m/bn1.weight' is missing"):
        train.load_checkpoint(tmp_path, other_opt)
    wider = TinyConfig(num_classes=5)
    other_net = train.init_state(tiny, wider, tiny.init(jax.random.key(1), wider), train.nesterov())
    with pytest.raises(ValueError, match=r"first mismatching tensor 'params/fc.weight' is float32 \(3, 48\), "
                                         r"this run expects float32 \(5, 48\)"):
        train.load_checkpoint(tmp_path, other_net)
    file.write_bytes(file.read_bytes()[:300])
    with pytest.raises(ValueError, match="not a readable gradtie checkpoint") as err:
        train.load_checkpoint(tmp_path, result.state)
    assert str(file) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train.load_checkpoint(tmp_path / "empty", result.state)


@pytest.mark.parametrize("change, match", [
    (dict(epochs=0), "epochs must be a positive integer"),
    (dict(mix="cutout"), "mix must be"),
    (dict(optimizer="lamb"), "expected one of"),
    (dict(lr=-1.0), "lr must be a positive number"),
    (dict(warmup_epochs=-1), "warmup_epochs must be a non-negative integer"),
    (dict(grads="finite-differences"), "'rendered' or 'autodiff'"),
])
def test_fit_config_rejects_bad_values(change, match):
    with pytest.raises(ValueError, match=match):
        replace(FIT, **change)


@pytest.mark.parametrize("config, kwargs, match", [
    (replace(FIT, batch=100), {}, "no full batch"),
    (FIT, dict(stop_after=0), "stop_after must be a positive integer"),
    (FIT, dict(resume=True), "need the run's folder"),
    (dict(FIT.__dict__), {}, "config must be a train.FitConfig"),
])
def test_fit_rejects_bad_arguments(config, kwargs, match):
    with pytest.raises(ValueError, match=match):
        train.fit(tiny, TINY, tiny_split(), config, **kwargs)


# ---- rendered vs autodiff, side by side ------------------------------------------------------------

def test_side_by_side_autodiff_within_the_envelope_and_the_control_out_f64():
    x = np.random.default_rng(0).standard_normal((48, 3, 4, 4))
    y = np.random.default_rng(1).integers(0, 3, 48)
    split = data.Split(x, y, x[:8], y[:8])
    run = train.FitConfig(optimizer="nesterov", lr=0.1, batch=8, epochs=2, dtype="float64")
    swap = bugs.plant("bn_swap_dgamma_dbeta", tiny)
    tr = train.side_by_side(tiny, TINY, split, run, steps=8, controls=[swap], progress=False)
    assert tr.ok, tr.summary()
    assert tr.steps.tolist() == list(range(1, 9)) and tr.envelope.shape == (8,)
    assert np.all(tr.envelope > 0) and tr.worst_ratio("autodiff") <= tr.factor
    assert tr.controls == ["bn_swap_dgamma_dbeta"] and tr.steps_over("bn_swap_dgamma_dbeta") == 8
    assert "within the bound at 8/8 smooth steps" in tr.summary() and np.all(tr.kinks == 0)
    # the free runs take the same first step from the same weights
    assert tr.loss["rendered"][0] == pytest.approx(tr.loss["autodiff"][0], rel=1e-12)
    # the verdict itself can fail: the control's distances in the autodiff row are out
    assert not tr._replace(distance={"autodiff": tr.distance["bn_swap_dgamma_dbeta"]}).ok
    # the rendered run is `fit`'s run of the same config, step for step
    epoch = train.fit(tiny, TINY, split, run, stop_after=1, progress=False).history[0]
    assert epoch["loss"] == sum(tr.loss["rendered"][:6]) / 6
    with pytest.raises(ValueError, match="planted chain"):
        train.side_by_side(tiny, TINY, split, run, steps=2, controls=[tiny])


def test_steps_at_a_kink_are_not_judged_and_the_rest_are():
    t = train.Tracking(np.arange(1, 4), {}, {}, np.zeros(3), {"autodiff": np.array([1e-9, 5e-6, 1e-9])},
                       np.full(3, 1e-8), np.array([0, 1, 0]), 10.0, 3, "float32")
    assert t.ok and t.steps_over("autodiff") == 0 and t.smooth.tolist() == [True, False, True]
    assert not t._replace(kinks=np.zeros(3, int)).ok          # the same jump at a smooth step is red
    assert not t._replace(kinks=np.ones(3, int)).ok           # nothing smooth: no verdict to give


def pooled_net(mix):
    """A one-stage net whose one pool window reads cells (a·x₀, b·x₁): twins when `mix` multiplies
    both cells by the same weight a, non-twins when each cell has its own weight."""
    def forward(params, x, cfg, how):
        a, b = params["a"], params["a"] if mix == "twin" else params["b"]
        x0, x1 = x[:, 0, 0, 0], x[:, 1, 0, 0]
        r = jnp.stack([a * x0, b * x1, jnp.zeros_like(x0), jnp.zeros_like(x0)], -1).reshape(x.shape[0], 1, 2, 2)
        return r, r

    pool = Stage("pool", "pool", forward, None, ("a", "b"), pool_inputs=lambda r: {"pool": r})
    specs = [ParamSpec("a", (), "zeros"), ParamSpec("b", (), "zeros")]
    return Net(f"pooled ({mix})", protocol.Config, lambda cfg: specs, lambda cfg: [pool], pools={"pool": maxpool.POOL2},
               channels=2, default_size=1)


@pytest.mark.parametrize("mix, count", [("twin", 0), ("own", 1)])
def test_kinks_count_ties_a_weight_nudge_breaks(mix, count):
    params = {"a": jnp.asarray(1.5), "b": jnp.asarray(1.5)}
    nudged = {"a": jnp.nextafter(params["a"], jnp.inf), "b": jnp.nextafter(params["b"], -jnp.inf)}
    x = jnp.asarray([[2.0, 2.0], [1.0, 3.0]])[:, :, None, None]     # example 0 tied, example 1 strict
    assert int(train.kinks(pooled_net(mix), protocol.Config(), params, nudged, x)) == count


def test_nudge_ulp_moves_each_nonzero_entry_one_ulp():
    x = jnp.asarray([0.0, 1.0, -2.5, 3e-3], jnp.float32)
    y = train.nudge_ulp(x, jax.random.key(0))
    assert float(y[0]) == 0.0
    for a, b in zip(np.asarray(x)[1:], np.asarray(y)[1:]):
        assert b in (np.nextafter(a, np.float32(np.inf)), np.nextafter(a, np.float32(-np.inf)))


# ---- cifar8: rendered steps on digits ------------------------------------------------------

@pytest.fixture(scope="module")
def c8():
    cfg = cifar8.Config(head_width=64)
    split = data.digits(seed=0)
    stats = jax.jit(lambda p, x: cifar8.NET.batch_stats(cifar8.NET.forward(p, x, cfg)[1]))
    return SimpleNamespace(net=cifar8.NET, cfg=cfg, x=split.x_train[:16], y=split.y_train[:16], stats=stats)


def test_cifar8_rendered_steps_decrease_the_loss_on_digits_f32(c8):
    opt = train.sgd()
    state = train.init_state(c8.net, c8.cfg, c8.net.init(jax.random.key(0), c8.cfg), opt)
    step = train.make_step(c8.net, c8.cfg, opt)
    x, y = jnp.asarray(c8.x[:8]), jnp.asarray(c8.y[:8])
    losses = []
    for _ in range(5):
        state, m = step(state, x, y, 0.05)
        losses.append(float(m["loss"]))
    assert state.params["conv1.weight"].dtype == jnp.float32
    assert losses[-1] < 0.7 * losses[0], losses


def test_cifar8_rendered_step_equals_autodiff_step_and_tracks_running_stats_f64(c8):
    """One SGD step from the same point: the rendered and the autodiff step give the same params.

    Each node is compared on its update Δθ = −lr·g. The conv biases sit behind BN, so their
    gradient is 0 in ℝ and both sides carry round-off only: for them the bar is the tie tolerance
    times the net's largest update (the tie's absolute floor), and they must be that small.
    """
    opt = train.sgd()
    params = {k: v.astype(jnp.float64) for k, v in c8.net.init(jax.random.key(0), c8.cfg).items()}
    x0, x1 = jnp.asarray(c8.x[:8], jnp.float64), jnp.asarray(c8.x[8:16], jnp.float64)
    y0, y1 = jnp.asarray(c8.y[:8]), jnp.asarray(c8.y[8:16])
    steps = {g: train.make_step(c8.net, c8.cfg, opt, grads=g) for g in ("rendered", "autodiff")}
    after = {g: f(train.init_state(c8.net, c8.cfg, params, opt), x0, y0, 0.1)[0] for g, f in steps.items()}
    moves = {k: float(jnp.max(jnp.abs(after["autodiff"].params[k] - params[k]))) for k in params}
    largest = max(moves.values())
    zero_nodes = {k for k, m in moves.items() if m <= TIE_TOL * largest}
    assert zero_nodes == {f"conv{j}.bias" for j in range(1, 9)}
    for k in params:
        err = float(jnp.max(jnp.abs(after["rendered"].params[k] - after["autodiff"].params[k])))
        assert err <= TIE_TOL * (largest if k in zero_nodes else moves[k]), (k, err, moves[k])
    # the control: the autodiff step with bn3's γ and β updates swapped goes red on both
    auto = after["autodiff"].params
    swapped = {**auto, "bn3.weight": params["bn3.weight"] + (auto["bn3.bias"] - params["bn3.bias"]),
               "bn3.bias": params["bn3.bias"] + (auto["bn3.weight"] - params["bn3.weight"])}
    for k in ("bn3.weight", "bn3.bias"):
        err = float(jnp.max(jnp.abs(after["rendered"].params[k] - swapped[k])))
        assert err > 1e3 * TIE_TOL * moves[k], k

    # running statistics: the first step copies the batch's, the second averages (0.99, 0.01)
    s1 = after["rendered"]
    batch0 = c8.stats(params, x0)
    for name, v in batch0.items():
        np.testing.assert_allclose(s1.running[name], v, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(after["autodiff"].running[name], v, rtol=1e-12, atol=1e-15)
    s2, _ = steps["rendered"](s1, x1, y1, 0.1)
    batch1 = c8.stats(s1.params, x1)
    for name in batch0:
        np.testing.assert_allclose(s2.running[name], 0.99 * batch0[name] + 0.01 * batch1[name],
                                   rtol=1e-12, atol=1e-15)
    assert set(s2.running) == {f"bn{j}.{s}" for j in range(1, 9) for s in ("running_mean", "running_var")}
    acc = train.evaluate(c8.net, c8.cfg, s2, c8.x, c8.y, batch=8)
    assert 0.0 <= acc <= 1.0


@pytest.mark.slow   # the chapter follows 88 steps of it (Training with the rendered step)
def test_cifar8_side_by_side_on_digits_f32(c8):
    """A few steps of a digits run (from step 2 on, γ ≠ 1 and β ≠ 0): the autodiff step lands within
    the one-ulp envelope of the rendered step at each, γ↔β swapped far outside. SGD shares the
    compiled rendered step with the test above."""
    split = data.Split(c8.x, c8.y, c8.x[:8], c8.y[:8])
    tr = train.side_by_side(c8.net, c8.cfg, split, train.FitConfig(optimizer="sgd", lr=0.05, batch=8, epochs=2),
                            steps=3, progress=False, controls=[bugs.plant("bn_swap_dgamma_dbeta", cifar8.NET)])
    assert tr.ok, tr.summary()
    assert np.all(tr.distance["autodiff"] > 0)          # float32: the two chains round differently
    assert np.all(tr.distance["bn_swap_dgamma_dbeta"] > 100 * tr.bound)
