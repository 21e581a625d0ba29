"""SyncBf16's exact difference against the mesh's bits (`gradtie.sync_bf16`): the statement's
formula predicts the all-reduced bf16 weight gradient bit for bit; a prediction without the
difference term, or without the per-replica rounding, misses it. On two host devices in a child
process (XLA reads the device count once, when JAX starts)."""

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
cfg = cifar8.Config(head_width=64, bf16=True)
params = cifar8.NET.init(jax.random.key(0), cfg, weights="drawn")
x = jnp.asarray(data.photos(4, 32, seed=0), jnp.float32)
rep = sync_bf16.exact_difference(bf16.mesh_replica_sum(cifar8.NET, params, x, jnp.arange(4) % 10, cfg,
                                                       mesh=parallel.data_mesh(2)))
print(rep.table())
print(json.dumps({"exact": rep.exact, "controls_red": rep.controls_red, "shared": len(rep.at(True)),
                  "rows": len(rep.rows), "no_term": rep.share("no_term"), "no_rounding": rep.share("no_rounding"),
                  "nonzero": min(r.nonzero for r in rep.rows)}))
"""


def test_the_formula_predicts_the_all_reduced_bits_and_its_controls_miss_them():
    env = dict(os.environ, XLA_FLAGS=fake_devices.with_host_devices(os.environ.get("XLA_FLAGS", ""), 2))
    out = subprocess.run([sys.executable, "-c", MESH], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rows"] == 8 and got["shared"] == 8, out.stdout
    assert got["exact"] and got["nonzero"] > 0, out.stdout
    assert got["controls_red"] and got["no_term"] < 0.5 and got["no_rounding"] < 0.5, out.stdout
