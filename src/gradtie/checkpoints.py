"""Checkpoints a cluster can resume: orbax's CheckpointManager over a run folder's `checkpoints/`.

One checkpoint is one step's folder, `checkpoints/<step>/`, holding three items:

    state   the train state (parameters, optimizer state, BN running statistics, step), written by
            every process for the arrays' shards it holds (orbax's StandardSave; replicated arrays
            are written once)
    meta    the run's per-epoch history and the sums of the epoch in progress (JSON, written once)
    data    the input pipeline's position, one JSON file per process (grain's own orbax handler),
            present where the run reads a folder through `gradtie.pipeline`

Saves are asynchronous: `save` returns once the arrays are copied off the device, and the files
are written while training goes on. orbax writes each checkpoint into a temporary folder and
renames it when every process is done, so an interrupted write leaves the last complete
checkpoint the newest one `latest_step` sees; the temporary folder is removed by the next save.
Kept: the last `keep` checkpoints and the one with the best test accuracy (top-1, precise BN).

Beyond the suite: the suite states train steps, not how a run is stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple, Optional

import jax
import numpy as np

FOLDER = "checkpoints"
BEST_METRIC = "test_accuracy"
NOT_EVALUATED = -1.0     # the metric of a checkpoint taken mid-epoch (accuracies lie in [0, 1])


def _ocp():
    import orbax.checkpoint as ocp
    return ocp


class _StateBox:
    """The pipeline's position in the shape grain's orbax handler expects of an iterator
    (`get_state() -> bytes`, `set_state(bytes)`): one JSON record per process."""

    def __init__(self, state: Optional[dict] = None):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()

    def set_state(self, raw: bytes) -> None:
        self.state = json.loads(raw)

    def start_prefetch(self) -> None:   # called by the handler after set_state
        pass


class Restored(NamedTuple):
    state: Any                 # the train state, on the template's shardings
    meta: dict
    data: Optional[dict]       # the pipeline's position (None: the run reads no folder)
    step: int


class Checkpoints:
    """The checkpoints of one run folder (`out/checkpoints`)."""

    def __init__(self, out, *, keep: int = 3):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"checkpoints: keep must be a positive integer, got {keep!r}")
        ocp = _ocp()
        from orbax.checkpoint import checkpoint_managers as cm

        self.directory = Path(out).absolute() / FOLDER
        self.keep = keep
        policy = cm.AnyPreservationPolicy([
            cm.LatestN(n=keep),
            cm.BestN(get_metric_fn=_metric, n=1, keep_checkpoints_without_metrics=False)])
        # best_fn makes orbax write each checkpoint's metrics (read back after a restart)
        options = ocp.CheckpointManagerOptions(preservation_policy=policy, best_fn=_metric, best_mode="max",
                                               enable_async_checkpointing=True, create=True,
                                               cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def exists(self) -> bool:
        return self.latest_step() is not None

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def best_step(self) -> Optional[int]:
        """The kept step with the best test accuracy (None before the first evaluation)."""
        scored = [(_metric(m), step) for step in self.steps() if (m := self.manager.metrics(step))]
        scored = [(v, step) for v, step in scored if v > NOT_EVALUATED]
        return max(scored)[1] if scored else None

    def save(self, step: int, state, meta: dict, *, data: Optional[dict] = None,
             metrics: Optional[dict] = None) -> None:
        """Start writing `state`, `meta` and the pipeline position `data` as checkpoint `step`;
        `metrics` ({"test_accuracy": top-1}) makes it a candidate for "best" (None: taken mid-epoch,
        never the best). Returns before the files are written (`wait` waits)."""
        ocp = _ocp()
        items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if data is not None:
            import grain
            items["data"] = grain.checkpoint.CheckpointSave(_StateBox(data))
        metrics = {BEST_METRIC: NOT_EVALUATED} if metrics is None else {BEST_METRIC: float(metrics[BEST_METRIC])}
        self.manager.save(int(step), args=ocp.args.Composite(**items), metrics=metrics, force=True)

    def restore(self, template, step: Optional[int] = None) -> Restored:
        """Checkpoint `step` (default the latest), its arrays placed as `template`'s (a train state of
        arrays, or of `jax.ShapeDtypeStruct`s with shardings). A checkpoint of another net or
        optimizer is a ValueError naming the first tensor that differs."""
        ocp = _ocp()
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {str(self.directory)!r}")
        self.manager.wait_until_finished()
        folder = self.directory / str(step)
        _check_against(folder, _stored_tree(folder), template)
        abstract = jax.tree.map(_abstract, template)
        items = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
        has_data = (folder / "data").is_dir()
        if has_data:
            import grain
            box = _StateBox()
            items["data"] = grain.checkpoint.CheckpointRestore(box)
        try:
            got = self.manager.restore(step, args=ocp.args.Composite(**items))
        except ValueError as err:
            if "process_" in str(err):
                raise ValueError(f"checkpoint {str(folder)!r} was written by another number of processes "
                                 f"than the {jax.process_count()} of this run ({err})") from None
            raise
        state = type(template)(*got["state"]) if hasattr(template, "_fields") else got["state"]
        return Restored(state, dict(got["meta"]), box.state if has_data else None, step)

    def wait(self) -> None:
        """Wait for the last save's files."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _metric(metrics: dict) -> float:
    return float(metrics.get(BEST_METRIC, NOT_EVALUATED))


def _stored_tree(folder: Path) -> dict:
    """The state item's tree of array metadata (shapes, dtypes), read without the arrays."""
    from etils import epath
    try:
        return _ocp().StandardCheckpointHandler().metadata(epath.Path(folder) / "state").tree
    except Exception as err:    # a folder orbax did not write, or one damaged since
        raise ValueError(f"checkpoint {str(folder)!r} is not a readable gradtie checkpoint "
                         f"({type(err).__name__}: {' '.join(str(err).split())[:200]})") from err


def _abstract(leaf):
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=getattr(leaf, "sharding", None))


def _paths(tree, prefix: str = "") -> dict[str, tuple]:
    """'params/conv1.weight' -> (shape, dtype) for every leaf of a state (NamedTuples and dicts)."""
    if hasattr(tree, "_fields"):
        tree = tree._asdict()
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_paths(v, f"{prefix}{k}/"))
        return out
    shape = tuple(getattr(tree, "shape", ()))
    return {prefix[:-1]: (shape, str(getattr(tree, "dtype", "")))}


def _check_against(folder: Path, stored, template) -> None:
    """One-line ValueError naming the first tensor of the checkpoint that the template lacks, holds
    with another shape, or holds and the checkpoint lacks."""
    want = _paths(template)
    have = _paths(stored)
    for key, (shape, _) in want.items():
        if key not in have:
            raise ValueError(f"checkpoint {str(folder)!r}: first mismatching tensor {key!r} is missing "
                             f"(was it written for another net or optimizer?)")
        if tuple(have[key][0]) != shape:
            raise ValueError(f"checkpoint {str(folder)!r}: first mismatching tensor {key!r} has shape "
                             f"{tuple(have[key][0])}, this run expects {shape}")
    extra = [k for k in have if k not in want]
    if extra:
        raise ValueError(f"checkpoint {str(folder)!r}: first mismatching tensor {extra[0]!r} is not in this "
                         f"run's state (was it written for another net or optimizer?)")


def read_params(out, step: Optional[int] = None) -> dict[str, np.ndarray]:
    """The parameters of a run folder's checkpoint `step` (default the latest), as host arrays in
    their stored dtype: what `gradtie check --weights RUN` reads."""
    ocp = _ocp()
    directory = Path(out).absolute() / FOLDER
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False)) as manager:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {str(directory)!r}")
        params = _stored_tree(directory / str(step))["params"]
        # host arrays in the stored dtype (float64 stays float64 whether or not JAX has x64 on)
        item = {"params": {k: np.zeros((), v.dtype) for k, v in params.items()}}
        restore = {"params": {k: ocp.RestoreArgs(restore_type=np.ndarray, dtype=v.dtype) for k, v in params.items()}}
        got = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=restore, partial_restore=True)))
    return {k: np.asarray(got["state"]["params"][k]) for k in params}
