"""Float64 on, fixed seeds, quick hypothesis profile."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_enable_x64", True)
settings.register_profile("gradtie", max_examples=15, deadline=None, derandomize=True)
settings.load_profile("gradtie")
