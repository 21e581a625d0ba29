"""The R·N sweep of `r34_net_syncTiedB` (`gradtie.sync_sweep`): every R from 1 and N, and a
degenerate global batch (a BatchNorm layer averaging M = 1 value) reported, never tied."""

import jax
import jax.numpy as jnp

from gradtie import sync_sweep
from gradtie.nets import resnet34


def test_splits_start_at_one_replica():
    assert sync_sweep.splits(4, 2) == [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2)]
    assert sync_sweep.splits(8, 4)[-1] == (8, 4) and len(sync_sweep.splits(8, 4)) == 12


def test_one_replica_of_one_example_at_32px_is_degenerate_and_not_tied():
    cfg = resnet34.Config(num_classes=10)
    params = {k: v.astype(jnp.float64) for k, v in resnet34.NET.init(jax.random.key(0), cfg, weights="drawn").items()}
    rep = sync_sweep.sweep(resnet34.NET, params, cfg, [(1, 1)], image_size=32, label_smoothing=0.1, progress=False)
    assert rep.ties == [] and rep.degenerate == {(1, 1): ("layer4.0.bn1", 1)}
    assert "1×1 degenerate (M = 1 at layer4.0.bn1), not judged" in rep.summary()
