"""SyncBf16's exact difference (`gradtie.sync_bf16`): the mesh's all-reduced bf16 weight gradient
minus 1/R of a single device's own batch-R·N node equals the statement's term bit for bit at almost
every entry and within the summation-order bound at all; the term without its difference, or without
the per-replica rounding, fails that. On two host devices in a child process (XLA reads the device
count once, when JAX starts)."""

import json
import os
import subprocess
import sys

from gradtie import fake_devices

MESH = """
import json, jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
from gradtie import data, parallel, sync_bf16
from gradtie.checks import bf16
from gradtie.nets import cifar8
from gradtie.nets.layers import rounding
cfg = cifar8.Config(head_width=64, bf16=True)
params = cifar8.NET.init(jax.random.key(0), cfg, weights="drawn")
x = jnp.asarray(data.photos(4, 32, seed=0), jnp.float32)
mesh = bf16.mesh_replica_sum(cifar8.NET, params, x, jnp.arange(4) % 10, cfg, mesh=parallel.data_mesh(2))
rep = sync_bf16.exact_difference(mesh, rounding(cfg))
# the control of the single device's run: its node rounded per example before the batch sum
wrong = sync_bf16.exact_difference(mesh, lambda a: a.astype(jnp.float32))
print(rep.table())
print(json.dumps({"exact": rep.exact, "controls_red": rep.controls_red, "rows": len(rep.rows),
                  "share": rep.share("exact"), "no_term": rep.share("no_term"),
                  "no_rounding": rep.share("no_rounding"), "nonzero": min(r.nonzero for r in rep.rows),
                  "unrounded_exact": wrong.exact}))
"""


def test_the_formula_predicts_the_all_reduced_bits_and_its_controls_miss_them():
    env = dict(os.environ, XLA_FLAGS=fake_devices.with_host_devices(os.environ.get("XLA_FLAGS", ""), 2))
    out = subprocess.run([sys.executable, "-c", MESH], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rows"] == 8, out.stdout
    assert got["exact"] and got["share"] >= 0.99 and got["nonzero"] > 0, out.stdout
    assert got["controls_red"] and got["no_term"] < 0.5 and got["no_rounding"] < 0.5, out.stdout
    # a single device that does not round its node (float32 operands and result) is another node
    assert not got["unrounded_exact"], out.stdout
