"""The float32 view of the whole-net tie: the rendered chain in float32 against the float64 oracle,
each node held to the float32 envelope at the point.

How close should a float32 chain be to float64? We let correct float32 evaluations say: the float32
autodiff oracle at the point, with the batch reversed and at ulp-nudged inputs and parameters, lands
some distance E from the float64 reference (`checks.envelope`); the rendered float32 node must be
within ENVELOPE_FACTOR·E of it, floored at F32_FLOOR of its scale. A node near a kink or behind a
small BatchNorm reduction has a large E, a well-conditioned node a small one: float32 is asked to be
as good as the conditioning allows, no better and no worse. Shown in: Whole-net tie.
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from ..host import to_device
from .tie import TieReport, tie


def float32_view(net, params, x, targets, cfg, *, label_smoothing: float = 0.0,
                 key: Optional[jax.Array] = None) -> TieReport:
    """The rendered chain of `net` in float32 against the float64 oracle, node by node, within the
    point's float32 envelope. params, x: any float dtype; both sides read the float32-rounded point
    (the reference widens it exactly), so the error is the float32 chain's own. Needs
    `jax_enable_x64`. A control (`checks.controls`) runs its planted float32 chain."""
    p32 = {k: to_device(v, np.float32) for k, v in params.items()}
    x32 = to_device(x, np.float32)
    return tie(net, p32, x32, targets, cfg, label_smoothing=label_smoothing, key=key)
