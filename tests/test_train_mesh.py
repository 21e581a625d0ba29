"""Training at scale: `train.fit` on a data mesh of host devices and across two processes against
one device; one replica is the single-device run bit for bit; a folder run interrupted mid-epoch
and resumed is the uninterrupted run bit for bit.

The mesh runs need their device count fixed before JAX starts, so they run in fresh interpreters
(tests/_train_mesh_worker.py): one process with four host devices, and two processes on 127.0.0.1
(gloo collectives) with two each, all three at once.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import checkpoints, data, folder, pipeline, train
from gradtie import tolerances as tol
from gradtie.fake_devices import without_device_count
from gradtie.nets import cifar8
from gradtie.nets.layers import zero_in_reals

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_train_mesh_worker.py"
TIMEOUT_S = 300
CONTROL_REL = 1e-3      # per-replica BatchNorm is another function: it parts from one device by far more


def worker_env() -> dict:
    env = dict(os.environ)
    # each worker sets its own device count; the other flags (conftest.py's) stay
    env["XLA_FLAGS"] = without_device_count(env.get("XLA_FLAGS", ""))
    env["JAX_PLATFORMS"] = "cpu"
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MESH_CFG = cifar8.Config(head_width=16)
# what the workers' `gradtie train` runs at the global batch of 16, on one device
MESH_RUN = train.FitConfig(optimizer="nesterov", lr=0.02, epochs=1, batch=16, dtype="float64", precise_batches=1)


def mesh_digits():
    return data.load("digits", n_train=32, n_test=16)


def rel(a, b) -> float:
    """The worst relative difference, tensor by tensor, of two train states' parameters and running
    statistics; the conv biases behind BatchNorm (0 in ℝ, round-off only) are left out."""
    skip = set(zero_in_reals(b.params))
    pairs = [(a.params[k], b.params[k]) for k in b.params if k not in skip] + \
        [(a.running[k], b.running[k]) for k in b.running]
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / np.max(np.abs(np.asarray(y)))) for x, y in pairs)


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / train.METRICS).read_text().splitlines()]


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    """The three worker processes (tests/_train_mesh_worker.py), started together; meanwhile, in this
    process, the same run on one device and its round-off envelope. Every run's final state read
    back from its orbax checkpoint."""
    out = tmp_path_factory.mktemp("mesh")
    port = free_port()
    cmds = [[sys.executable, str(WORKER), "mesh", str(out)]] + [
        [sys.executable, str(WORKER), "process", str(i), str(port), str(out)] for i in range(2)]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(),
                              cwd=HERE.parent) for c in cmds]
    try:
        r1 = train.fit(cifar8.NET, MESH_CFG, mesh_digits(), MESH_RUN, progress=False)
        # the envelope: the same run with every batch's rows reversed, the same run in ℝ whose sums
        # (BatchNorm's statistics, the gradient's mean over the batch) are taken in another order
        real = train._Plan.batches
        with pytest.MonkeyPatch.context() as m:
            m.setattr(train._Plan, "batches", lambda self, epoch, start=0: (
                (i, x[::-1], t[::-1]) for i, x, t in real(self, epoch, start)))
            reversed_ = train.fit(cifar8.NET, MESH_CFG, mesh_digits(), MESH_RUN, progress=False)
        logs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, logs):
        assert p.returncode == 0, err[-4000:]
    said = [json.loads(log[0].strip().splitlines()[-1]) for log in logs]

    def final(name):
        kept = checkpoints.Checkpoints(out / name)
        try:
            return kept.restore(r1.state).state
        finally:
            kept.close()

    states = {"r1": r1.state, "r1_reversed": reversed_.state, **{n: final(n) for n in ("r4", "r4_local_bn", "p2")}}
    return {"said": said, "states": states, "r1": r1, "out": out}


def limit(states: dict) -> float:
    """10 × the single-device run's own round-off envelope (its batches' rows reversed), floored at
    the float64 floor of the tie kit."""
    return max(tol.ENVELOPE_FACTOR * rel(states["r1_reversed"], states["r1"]), tol.FLOORS["float64"])


def test_gradtie_train_on_four_host_devices_is_the_single_device_run(mesh_runs):
    said, states, out = mesh_runs["said"][0], mesh_runs["states"], mesh_runs["out"]
    r4, r1 = states["r4"], states["r1"]
    assert said["devices"] == 4 and int(r4.step) == int(r1.step) == 2
    print(f"4 replicas vs one device: {rel(r4, r1):.1e} (envelope {rel(states['r1_reversed'], r1):.1e}, "
          f"limit {limit(states):.1e}); per-replica BN: {rel(states['r4_local_bn'], r1):.1e}")   # pytest -s
    assert 0 < rel(states["r1_reversed"], r1) and rel(r4, r1) <= limit(states), (rel(r4, r1), limit(states))
    mesh, one = history(out / "r4")[-1], mesh_runs["r1"].history[-1]
    assert mesh["devices"] == 4 and one["devices"] == 1
    for k in ("test_accuracy", "test_top5", "test_accuracy_running", "train_accuracy"):
        assert mesh[k] == one[k], k                         # the mesh's evaluation counts the same hits
    assert abs(mesh["loss"] - one["loss"]) <= limit(states) * abs(one["loss"])
    assert said["last_line"] == f"test accuracy: {one['test_accuracy']:.4f}"
    run = json.loads((out / "r4" / "run.json").read_text())
    assert (run["replicas"], run["processes"], run["global_batch"], run["batch"], run["checkpoints"]) == \
        (4, 1, 16, 4, "orbax")
    # the control: per-replica BatchNorm is another function of the weights
    assert rel(states["r4_local_bn"], r1) > CONTROL_REL
    # another device count cannot resume the run: exit 3, one line naming both counts
    refused = said["refused"]
    assert refused["code"] == 3 and len(refused["err"].strip().splitlines()) == 1
    assert "on 2 device(s) in 1 process(es)" in refused["err"] and "trained on 4 device(s) in 1 process(es)" in refused["err"]


def test_two_processes_of_two_devices_are_one_process_of_four(mesh_runs):
    said, states, out = mesh_runs["said"][1:], mesh_runs["states"], mesh_runs["out"]
    assert [s["process"] for s in said] == [0, 1] and all(s["processes"] == 2 and s["devices"] == 4 for s in said)
    # process 0 prints and writes run.json and metrics.jsonl; every process writes its checkpoint shards
    assert said[0]["out"].strip().splitlines()[-1].startswith("test accuracy: ") and said[1]["out"] == ""
    print(f"2 processes × 2 devices vs 1 × 4: {rel(states['p2'], states['r4']):.1e}, "
          f"vs one device: {rel(states['p2'], states['r1']):.1e} (limit {limit(states):.1e})")   # pytest -s
    assert rel(states["p2"], states["r4"]) <= limit(states), (rel(states["p2"], states["r4"]), limit(states))
    assert rel(states["p2"], states["r1"]) <= limit(states)
    assert rel(states["p2"], states["r4_local_bn"]) > CONTROL_REL      # the control, from this side too
    run = json.loads((out / "p2" / "run.json").read_text())
    assert (run["replicas"], run["processes"], run["global_batch"], run["batch"]) == (4, 2, 16, 4)
    assert [h["test_accuracy"] for h in history(out / "p2")] == [h["test_accuracy"] for h in history(out / "r4")]


# ---- in this process: one device --------------------------------------------------------------------

# one net, batch and image size for every run below: they share their compiled programs
CFG = cifar8.Config(head_width=16, num_classes=7)
BATCH = 8


def test_one_replica_is_the_single_device_loop_bit_for_bit(tmp_path):
    """`fit` with replicas=1 takes the steps the single-device loop always took: that loop, written
    out here (the batch order, the flips, the schedule, `make_step`), lands on the same bits; one
    batch in another order does not."""
    photos = data.load("photos", n_train=3 * BATCH, n_test=16)
    config = train.FitConfig(optimizer="nesterov", lr=0.02, epochs=2, batch=BATCH, precise_batches=1, eval_batch=16,
                             replicas=1)
    result = train.fit(cifar8.NET, CFG, photos, config, out=tmp_path / "run", progress=False, stop_after=1)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["checkpoints"] == "npz"
    assert (tmp_path / "run" / train.CHECKPOINT).is_file()

    def loop(swap_last: bool):
        key = jax.random.key(0)
        params = {k: v.astype(jnp.float32) for k, v in cifar8.NET.init(jax.random.fold_in(key, 0), CFG).items()}
        opt = train.nesterov()
        state = train.init_state(cifar8.NET, CFG, params, opt)
        step = train.make_step(cifar8.NET, CFG, opt)
        sched = train.cosine_warmup(0.02, 0, 6)
        k_batch, k_flip, _ = jax.random.split(jax.random.fold_in(key, 1), 3)
        for i, (xb, yb) in enumerate(data.batches(photos.split.x_train, photos.split.y_train, BATCH, key=k_batch)):
            if swap_last and i == 2:
                xb, yb = xb[::-1], yb[::-1]
            xb = data.augment_flip(jnp.asarray(xb, jnp.float32), jax.random.fold_in(k_flip, i))
            state, _ = step(state, xb, jnp.asarray(yb), sched(i))
        return state

    state = loop(swap_last=False)
    assert all(np.array_equal(state.params[k], result.state.params[k]) for k in state.params)
    assert all(np.array_equal(state.running[k], result.state.running[k]) for k in state.running)
    control = loop(swap_last=True)
    assert not all(np.array_equal(control.params[k], result.state.params[k]) for k in state.params)
    # a run recorded before meshes (no replicas, processes or checkpoint format in its run.json) resumes
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    for key in ("replicas", "processes", "global_batch", "checkpoints"):
        del record[key]
    (tmp_path / "run" / "run.json").write_text(json.dumps(record))
    resumed = train.fit(cifar8.NET, CFG, photos, replace(config, epochs=None), out=tmp_path / "run", resume=True,
                        progress=False)
    assert [h["epoch"] for h in resumed.history] == [1, 2]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["checkpoints"] == "npz"


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """7 classes × 4 training JPEGs (and a truncated one, an empty one, a README.txt), 2 val a class."""
    return folder.write_photo_folder(tmp_path_factory.mktemp("photos") / "photos", per_class=4, val_per_class=2,
                                     size=(48, 40), corrupt=True)


FOLDER_RUN = train.FitConfig(optimizer="nesterov", lr=0.02, epochs=2, batch=BATCH, precise_batches=1,
                             eval_batch=16, workers=0, keep=2)


def folder_fit(photos, out, **kwargs):
    return train.fit(cifar8.NET, CFG, photos, FOLDER_RUN, out=out, image_size=32, progress=False, **kwargs)


def interrupting(monkeypatch, at_step):
    """make_step whose step raises KeyboardInterrupt instead of taking step `at_step` (1-based)."""
    real = train.make_step

    def make_step(*args, **kwargs):
        step = real(*args, **kwargs)

        def wrapped(state, x, targets, lr):
            if int(state.step) + 1 == at_step:
                raise KeyboardInterrupt
            return step(state, x, targets, lr)
        return wrapped

    monkeypatch.setattr(train, "make_step", make_step)


def same_state(a, b) -> bool:
    return all(np.array_equal(getattr(a, part)[k], getattr(b, part)[k])
               for part in ("params", "running") for k in getattr(b, part))


def trajectory(history):
    return [{k: v for k, v in h.items() if k not in train.WALL_CLOCK} for h in history]


def test_folder_run_interrupted_mid_epoch_resumes_bit_for_bit(photos, tmp_path, monkeypatch):
    spe = len(photos.train) // FOLDER_RUN.batch                       # 30 files (two broken): 3 steps
    lines = []
    straight = folder_fit(photos, tmp_path / "a", log=lines.append)
    assert spe == 3 and [h["step"] for h in straight.history] == [3, 6]
    # the run names the README it skips by its name and the first file that does not decode, once each
    assert lines[0].startswith("skipped 1 file that is not JPEG or PNG by name") and "README.txt" in lines[0]
    assert lines[1].startswith("skipped ") and "broken_" in lines[1] and "metrics.jsonl" in lines[1]
    assert sum(line.startswith("skipped") for line in lines) == 2 and all("\n" not in line for line in lines)
    assert all(h["skipped_images"] >= 2 for h in straight.history)   # both broken files, every epoch
    run = json.loads((tmp_path / "a" / "run.json").read_text())
    assert run["data"]["classes"] == sorted(data.PHOTO_NAMES) and run["checkpoints"] == "orbax"
    assert run["data"]["name"] == f"folder:{photos.path}" and len(run["data"]["fingerprint"]) == 16

    with monkeypatch.context() as m:
        interrupting(m, at_step=spe + 2)
        with pytest.raises(KeyboardInterrupt):
            folder_fit(photos, tmp_path / "b")
    # the interrupted run's checkpoint: the step taken last and the pipeline's position at it
    kept = checkpoints.Checkpoints(tmp_path / "b")
    assert kept.latest_step() == spe + 1 and kept.steps() == [spe, spe + 1]
    got = kept.restore(straight.state)
    kept.close()
    assert got.data["step"] == spe + 1 and got.data["workers"] == 0 and len(got.meta["history"]) == 1
    resumed = folder_fit(photos, tmp_path / "b", resume=True)
    assert same_state(resumed.state, straight.state)
    assert trajectory(resumed.history) == trajectory(straight.history)
    # `gradtie check --weights RUN` reads an orbax run folder: the latest checkpoint's parameters
    params, _ = train.checkpoint_params(tmp_path / "b", cifar8.NET)
    assert all(np.array_equal(params[k], resumed.state.params[k]) for k in params)

    # the control: a resume that reads its epoch's last batch again in place of the next parts from it
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    for late in (tmp_path / "c" / "checkpoints").iterdir():
        if late.name.isdigit() and int(late.name) > spe + 1:
            shutil.rmtree(late)                         # back to where the interrupted run stood
    real = train._FolderFeed.batches
    with monkeypatch.context() as m:
        m.setattr(train._FolderFeed, "batches", lambda self, epoch, start: real(self, epoch, max(start - 1, 0)))
        replayed = folder_fit(photos, tmp_path / "c", resume=True)
    assert not same_state(replayed.state, straight.state)


def test_resuming_under_another_worker_count_reads_the_same_batches(photos):
    """grain's record of the position holds for the worker count it was taken under; under another
    one the reader starts at the step instead, and the batches are the same."""
    files = pipeline.Files(photos.train)
    layout = pipeline.Layout(8)
    reader = pipeline.Reader(files, size=16, seed=3, steps_per_epoch=3, epochs=2, layout=layout, workers=0)
    first = [next(reader) for _ in range(2)]
    state = reader.state()
    rest = [next(reader)["image"] for _ in range(3)]
    reader.close()
    for workers in (0, 1):
        again = pipeline.Reader(files, size=16, seed=3, steps_per_epoch=3, epochs=2, layout=layout, workers=workers)
        again.seek(2, state)
        got = [next(again)["image"] for _ in range(3)]
        again.close()
        assert all(np.array_equal(a, b) for a, b in zip(got, rest)), workers
    assert not np.array_equal(first[1]["image"], rest[0])     # the control: the batches do differ


def test_checkpoints_keep_the_last_k_and_the_best_and_an_interrupted_write_replaces_nothing(tmp_path):
    state = train.TrainState({"w": jnp.ones((2, 3))}, {}, {"bn.running_mean": jnp.ones(2)}, jnp.zeros((), jnp.int32))
    at = lambda s: state._replace(step=jnp.asarray(s, jnp.int32))  # noqa: E731
    kept = checkpoints.Checkpoints(tmp_path, keep=2)
    for step, accuracy in [(1, 0.5), (2, None), (3, 0.9), (4, None), (5, 0.6)]:   # None: taken mid-epoch
        kept.save(step, at(step), {"step": step}, metrics=None if accuracy is None else {"test_accuracy": accuracy})
    kept.close()
    folder = tmp_path / checkpoints.FOLDER
    assert sorted(p.name for p in folder.iterdir()) == ["3", "4", "5"]       # the last two and the best
    # a write cut off half way: orbax's temporary folder for step 6, never renamed into place
    partial = folder / "6.orbax-checkpoint-tmp-1234567"
    shutil.copytree(folder / "5", partial)
    (partial / "state" / "manifest.ocdbt").write_bytes(b"cut off")
    kept = checkpoints.Checkpoints(tmp_path, keep=2)
    assert (kept.latest_step(), kept.best_step()) == (5, 3)
    got = kept.restore(state)
    assert got.step == 5 and int(got.state.step) == 5 and got.meta == {"step": 5} and got.data is None
    with pytest.raises(ValueError, match=r"first mismatching tensor 'params/w' has shape \(2, 3\), this run "
                                         r"expects \(3, 3\)"):
        kept.restore(state._replace(params={"w": jnp.ones((3, 3))}))
    kept.save(6, at(6), {"step": 6})          # the next save clears the cut-off folder
    kept.close()
    assert sorted(p.name for p in folder.iterdir()) == ["3", "5", "6"]


def test_the_resnet34_imagenet_recipe_sets_upstreams_run_and_options_override_it(tmp_path, capsys):
    from gradtie import cli
    args = cli.parser().parse_args(["train", "--recipe", "resnet34-imagenet", "--data", "folder:/data/imagenet",
                                    "--replicas", "8", "--batch", "32", "--out", str(tmp_path / "r34")])
    o = cli._train_options(args)
    assert (o.net, o.optimizer, o.lr, o.epochs, o.warmup_epochs, o.label_smoothing, o.image_size, o.flip) == \
        ("resnet34", "heavy-ball", 0.1, 90, 5, 0.1, 224, True)
    assert (o.replicas, o.batch) == (8, 32)                                # given: they win
    assert train.make_optimizer(o.optimizer).hyper == {"momentum": 0.9, "weight_decay": 1e-4}
    assert (cli.RECIPES["resnet34-imagenet"]["replicas"], cli.RECIPES["resnet34-imagenet"]["batch"]) == (4, 64)
    # without an image folder the recipe has nothing to train on: one line, exit 3
    assert cli.main(["train", "--recipe", "resnet34-imagenet", "--out", str(tmp_path / "x")]) == 3
    err = capsys.readouterr().err
    assert "--data folder:PATH" in err and len(err.strip().splitlines()) == 1
