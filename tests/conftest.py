"""Float64 on, fixed seeds, quick hypothesis profile, one persistent compilation cache, and the
`slow` mark on the cases a chapter also shows (run them with `make test-all`)."""

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One on-disk compilation cache for the test workers and the interpreters they start (the mesh
# workers, `python -m gradtie check`): the same programs at the same shapes compile once a run.
_CACHE = os.environ.setdefault("GRADTIE_CACHE", str(Path.home() / ".cache" / "gradtie" / "jax-tests"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")   # the Makefile says why

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from gradtie.checks import bf16 as _bf16  # noqa: E402
from gradtie.checks import bugs as _bugs  # noqa: E402

jax.config.update("jax_enable_x64", True)
settings.register_profile("gradtie", max_examples=15, deadline=None, derandomize=True)
settings.load_profile("gradtie")

def _ascii(label: str) -> str:
    """A parameter label as pytest writes it in a node id (non-ASCII escaped, "×" as \\xd7)."""
    return label.encode("unicode_escape").decode()


# Repeats of claims a chapter shows under nbval: large-shape cases a smaller one here already
# checks, and cases a chapter runs at the same point with the same verdict; `make test` leaves them
# to `make test-all`.
SLOW = {
    # the mesh tie at R·N = 8: the Data-parallel chapter sweeps ResNet-34's R·N (R = 2 in its ci
    # profile, up to 8 in its cpu profile) and ties cifar8 on a mesh; the mesh step and uneven counts
    # (both at R = 4), the per-replica control and two processes stay here
    "tests/test_parallel.py::test_replica_mean_grads_equal_single_device_f64[resnet34]",
    "tests/test_parallel.py::test_replica_mean_grads_equal_single_device_f64[cifar8]",
    # the three sync entries through `gradtie check`: Would the check catch it? runs them on cifar8
    # through the same mesh tie (`bugs.run`), and test_check_cli_takes_uneven_replica_counts drives
    # one through the command's exit code
    "tests/test_parallel.py::test_synchronised_bn_catalogue_entries_exit_1_through_the_check[resnet34]",
    "tests/test_parallel.py::test_synchronised_bn_catalogue_entries_exit_1_through_the_check[cifar8]",
    # the ResNet-34 step ties: the Training chapter ties its heavy-ball step (110 tensors, two steps,
    # float64, drawn weights, photos); the 146-tensor case adds conv biases, nodes that are 0 in ℝ,
    # which cifar8's step ties here already hold to their limits
    "tests/checks/test_step.py::test_resnet34_step_tied_to_optax_f64[False-sgd-110]",
    "tests/checks/test_step.py::test_resnet34_step_tied_to_optax_f64[True-heavy-ball-146]",
    # ... and cifar8's Nesterov step (38 tensors with conv biases, two steps, float64, drawn weights:
    # every tensor, buffer and running statistic within its limit) with the no_lookahead control red
    # at step 1; the SGD and heavy-ball steps, the other controls and the init-weights case stay here
    "tests/checks/test_step.py::test_cifar8_step_tied_to_optax_f64[nesterov]",
    "tests/checks/test_step.py::test_update_rule_controls_go_red_at_step_1[nesterov-no_lookahead]",
    # ResNet-34's gradient tied to autodiff at a point, op by op: the Whole-net tie chapter ties every
    # node and the input at photos (batch 4) and at flat images (batch 2, M = 2 at layer4), drawn
    # weights, α = 0.1, and Would the check catch it? plants every ResNet-34 catalogue entry red (a
    # projection BN reading the wrong cotangent among them); the conv-bias case stays here (the
    # one net-level ResNet-34 tie of the unit tests), and so do the eighteen stages, the pool, the
    # saved views, the running statistics and the bad inputs (tests/nets/test_resnet34.py); 64 px is
    # the chapters' cpu profile
    "tests/nets/test_resnet34.py::test_loss_and_grads_equal_autodiff_f64[photos-64px-labels-a0.1]",
    "tests/nets/test_resnet34.py::test_loss_and_grads_equal_autodiff_f64[photos-32px-labels-a0]",
    "tests/nets/test_resnet34.py::test_loss_and_grads_equal_autodiff_f64[flat-32px-soft-a0.1]",
    "tests/nets/test_resnet34.py::test_rendered_chain_equals_autodiff_f64",
    "tests/nets/test_resnet34.py::test_input_cotangent_equals_autodiff_f64",
    "tests/nets/test_resnet34.py::test_doubled_cotangent_control_goes_red",
    "tests/nets/test_resnet34.py::test_swap_gamma_beta_control_goes_red",
    "tests/nets/test_resnet34.py::test_projection_bn_reads_da_control_goes_red",
    # the Training chapter follows the rendered and autodiff steps side by side (88 steps in its ci
    # profile, 100 in cpu and gpu), with the bound and the γ↔β control shown
    "tests/test_train.py::test_cifar8_side_by_side_on_digits_f32",
    # Would the check catch it? ties the real ResNet-34 chain and plants every entry at the same
    # point (flat images, 32 px, batch 2, drawn weights of key 0, α = 0.1) with the same verdict
    # (first failing row not ill-conditioned, error over limit > 1e3); the cifar8 rows stay here
    "tests/checks/test_bugs.py::test_real_chains_tie_at_the_catalogue_points[resnet34]",
    *(f"tests/checks/test_bugs.py::test_every_catalogue_entry_goes_red[{b.name}-resnet34]"
      for b in _bugs.entries("resnet34", replicas=False)),
    # Whole-net tie ties ResNet-34 at photos (batch 4, 32 px, drawn weights of key 0, α = 0.1: every
    # node, the input, smallest M = 4 at layer4.0.bn1) and on flat images (the frozen input model)
    "tests/checks/test_tie.py::test_resnet34_ties_every_node_and_the_input_at_photos_f64",
    "tests/checks/test_tie.py::test_twin_ties_tie_every_node_and_the_input_of_the_frozen_model[resnet34]",
    # ... and the M = 2 point (flat, batch 2, 32 px): float64 tied with its limits widened, float32
    # too ill-conditioned to judge at every node; `gradtie check`'s exit 2 and its wording for such a
    # point stay here (test_an_ill_conditioned_point_exits_2_naming_the_layer), cifar8 drives the
    # command end to end
    "tests/test_cli_check.py::test_the_degenerate_resnet_point_ties_with_its_envelope_shown",
    "tests/test_cli_check.py::test_float32_at_the_degenerate_point_cannot_be_judged_and_says_so",
    # ... and plants projection_bn_reads_dn2 in ResNet-34, whose first parting stage it asserts is
    # layer4.0 (a downsample block); its N sweep runs cifar8 at N = 1, 2, 4 with the same verdicts
    "tests/checks/test_stages.py::test_resnet34_projection_bug_parts_at_a_downsample_block",
    "tests/checks/test_stages.py::test_sweep_ties_every_n_and_states_the_smallest",
    # bf16 erasure runs ResNet-34 (batch 4, 32 px, drawn weights) through the same verdicts: the
    # chain at rnd = identity bit for bit, every bf16 node within its envelope, every control red;
    # the site names and strides stay here (test_resnet_sites_cover_every_conv_node)
    "tests/checks/test_bf16.py::test_whole_chain_at_identity_is_the_f32_chain_bit_for_bit[r34]",
    "tests/checks/test_bf16.py::test_every_bf16_node_is_its_ops_derivative_within_the_envelope[r34_gradient]",
    *(f"tests/checks/test_bf16.py::test_control_zeroed_flipped_or_scaled_node_fails[{_ascii(c)}-r34_gradient]"
      for c in _bf16.CONTROLS),
    # the two ResNet-34 controls are catalogue entries: Would the check catch it? plants both in
    # ResNet-34 and prints the first failing node of each under nbval; the cifar8 controls stay here
    "tests/checks/test_controls.py::test_resnet34_real_chain_ties_where_its_controls_run",
    "tests/checks/test_controls.py::test_pool2x2_backward_on_3x3_control_goes_red",
    "tests/checks/test_controls.py::test_same_padding_strided_control_goes_red",
    # Stage germs walks cifar8's germs at photos and asserts each verdict these walks check: S and G
    # bit for bit below δ and parted beyond (straight and curved), δ predicted, finite differences
    # converging and wrong nodes failing, a close kink giving no evidence, twin ties keeping the germ,
    # none at a non-twin tie; the synthetic verdict tests and the refusals stay here
    *(f"tests/checks/test_germs.py::{t}[{k}]" for k in ("straight", "curved")
      for t in ("test_bit_identical_below_delta_and_parts_beyond", "test_delta_predicted_to_second_order",
                "test_fd_converges_with_evidence_and_rejects_wrong_nodes")),
    "tests/checks/test_germs.py::test_split_losses_bracket_delta",
    "tests/checks/test_germs.py::test_loss_roundoff_is_roundoff",
    "tests/checks/test_germs.py::test_close_kink_gives_no_evidence",
    "tests/checks/test_germs.py::test_twin_ties_keep_the_germ_bit_for_bit",
    "tests/checks/test_germs.py::test_no_germ_at_a_non_twin_tie",
}


@pytest.fixture
def compilations():
    """`compilations(f)` -> (f(), how many programs JAX compiled or read from the cache meanwhile)."""
    def run(f):
        events = []

        def listener(event, duration, **kw):
            if "backend_compile" in event:
                events.append(event)
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            return f(), len(events)
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
    return run


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a repeat of a case a chapter also shows (make test-all)")


# The files holding the longest tests are collected first, so that the two workers share them early
# and finish together on short ones; left in collection order, the mesh tests ran last and one worker
# waited on them. Worker seconds of `make test`'s unit tests on a warm cache, 2-core CPU: 71, 36, 35,
# 32, 27, 25, 25, 20, 19 in this order, and every other file under 14.
FIRST = ("tests/test_parallel.py", "tests/nets/test_resnet34.py", "tests/checks/test_step.py",
         "tests/checks/test_stages.py", "tests/checks/test_bf16.py", "tests/checks/test_bugs.py",
         "tests/checks/test_census.py", "tests/test_cli_check.py", "tests/test_cli.py")


# `make test` runs nbval's chapters and the unit tests in one session (`--dist loadscope`: each
# chapter's cells in order on one worker, each test file on one worker). The chapters go first, in
# the order the command line gives them (longest first), then the test files, longest first, so
# that the short ones end the session (one checkout, one after the other: 485 s against 493 s for
# `make unit nbval`, within the machine's noise).
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
    # a stable sort: within a file, and among the files not listed, collection order stays
    rank = {name: i for i, name in enumerate(FIRST)}
    path = lambda item: item.nodeid.split("::")[0]  # noqa: E731
    items.sort(key=lambda item: -1 if path(item).endswith(".ipynb") else rank.get(path(item), len(FIRST)))
