"""Orbax checkpoints of a `TrainState` (step N: SAVE_DIR/N, items `state`, the
arrays, and `meta`, JSON with the run's options and each process's SHA-256 of
its arrays), and resuming from the newest one that reads back intact."""

import asyncio
import contextlib
import hashlib
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from benchmarks import _device

from .config import FORMAT, RunConfig, UsageError
from .metrics import first_line, say
from .model import Placement, TrainState, abstract_state


class Damaged(Exception):
    """A checkpoint that cannot be read or does not match its content hash."""


def content_sha256(arrays: Any) -> str:
    """SHA-256 of this process's bytes of every array, with their pytree paths:
    the whole array if this process sees all of it, else its shards of replica 0
    with their index (what it writes, and reads back into the same shardings)."""
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_leaves_with_path(arrays):
        h.update(jax.tree_util.keystr(path).encode())
        if x.is_fully_addressable:
            parts = [("", x)]
        else:
            shards = [s for s in x.addressable_shards if s.replica_id == 0]
            parts = sorted(
                ((repr(s.index), s.data) for s in shards), key=lambda p: p[0]
            )
        for index, data in parts:
            h.update(index.encode())
            h.update(np.ascontiguousarray(jax.device_get(data)).tobytes())
    return h.hexdigest()


def open_manager(save_dir: Path, keep: int) -> ocp.CheckpointManager:
    # Not `cleanup_tmp_directories`: its thread is not joined by close() and fails
    # at exit. Orbax ignores the unfinished save of a second Ctrl-C.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=True, create=True
    )
    return ocp.CheckpointManager(save_dir.absolute(), options=options)


def save_checkpoint(
    mgr: ocp.CheckpointManager, step: int, state: TrainState, meta: dict[str, Any]
) -> None:
    """Start saving `state` as step `step` (Orbax writes in the background), with
    every process's `content_sha256`, in process order."""
    arrays = eqx.filter(state, eqx.is_array)
    mine = np.frombuffer(bytes.fromhex(content_sha256(arrays)), dtype=np.uint8)
    hashes = [bytes(h).hex() for h in multihost_utils.process_allgather(mine)]
    meta = {**meta, "step": step, "sha256": hashes}
    items = dict(state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta))
    mgr.save(step, args=ocp.args.Composite(**items), force=True)


def _restore(mgr: ocp.CheckpointManager, step: int, **items: Any) -> dict[str, Any]:
    """`mgr.restore` of `items`; any failure is `Damaged`."""
    try:
        with settled_reads():
            return mgr.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:
        text = first_line(e, 200).split(" See full TensorStore details")[0]
        raise Damaged(f"{type(e).__name__}: {text}") from None


def read_meta(mgr: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The JSON item of step `step`; `Damaged` unless it is this script's."""
    meta = _restore(mgr, step, meta=ocp.args.JsonRestore())["meta"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise Damaged(f"expected a JSON item of format {FORMAT!r}")
    if missing := {"config", "corpus_sha256", "sha256"} - set(meta):
        raise Damaged(f"its JSON item lacks {', '.join(sorted(missing))}")
    try:
        RunConfig(**meta["config"])
    except TypeError as e:
        raise Damaged(f"its JSON item has other run options: {e}") from None
    hashes, processes = meta["sha256"], jax.process_count()
    if not isinstance(hashes, list) or len(hashes) != processes:
        raise Damaged(f"its content hash is not one per process ({processes} now)")
    return meta


def restore_state(
    mgr: ocp.CheckpointManager, step: int, like: TrainState, meta: dict[str, Any]
) -> TrainState:
    """The `TrainState` of step `step` in the shapes, dtypes and shardings of
    `like` (`jax.ShapeDtypeStruct`s); `Damaged` unless it has `meta`'s hash."""
    arrays, static = eqx.partition(like, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    restored = _restore(mgr, step, state=ocp.args.StandardRestore(arrays))["state"]
    ok = content_sha256(restored) == meta["sha256"][jax.process_index()]
    # Every host falls back together.
    if not np.all(multihost_utils.process_allgather(np.int32(ok))):
        raise Damaged("its arrays do not match the SHA-256 recorded when it was saved")
    return eqx.combine(restored, static)


# Orbax restores the arrays in one `asyncio.gather` on an event loop that it closes
# as soon as the gather returns: when one read fails, the others finish later on a
# closed loop, and Python reports each one ("Event loop is closed"). Within
# `settled_reads`, a loop first lets its tasks finish (cancelled after SETTLE_S).
SETTLE_S = 60.0


class _SettlingLoop(asyncio.SelectorEventLoop):
    def close(self) -> None:
        if not self.is_closed() and not self.is_running():
            self.run_until_complete(_settle(asyncio.all_tasks(self)))
        super().close()


async def _settle(tasks: set[asyncio.Task]) -> None:
    if tasks:
        _, late = await asyncio.wait(tasks, timeout=SETTLE_S)
        for task in late:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0)  # the callbacks of tasks that finished just before


@contextlib.contextmanager
def settled_reads() -> Iterator[None]:
    """Within: the event loops Orbax makes close only once their reads are done."""
    with warnings.catch_warnings():  # the policy API is deprecated in Python 3.14
        warnings.simplefilter("ignore", DeprecationWarning)

        class Policy(asyncio.DefaultEventLoopPolicy):
            def new_event_loop(self) -> asyncio.AbstractEventLoop:
                return _SettlingLoop()

        previous = asyncio.get_event_loop_policy()
        asyncio.set_event_loop_policy(Policy())
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            asyncio.set_event_loop_policy(previous)


def set_aside(save_dir: Path, step: int) -> None:
    """Rename a damaged checkpoint `damaged-<step>` (kept for inspection; Orbax
    ignores it), so that the resumed run can save that step again."""
    if _device.is_main_process():
        target = save_dir / f"damaged-{step}"
        if target.exists():
            shutil.rmtree(target)
        (save_dir / str(step)).rename(target)
    multihost_utils.sync_global_devices("train_lm: set aside")


def newest_meta(mgr: ocp.CheckpointManager) -> dict[str, Any] | None:
    """The newest JSON item that reads back (the run's options), or `None`."""
    for step in sorted(mgr.all_steps(), reverse=True):
        with contextlib.suppress(Damaged):
            return read_meta(mgr, step)
    return None


def find_resume_point(
    mgr: ocp.CheckpointManager, save_dir: Path, placement: Placement | None
) -> tuple[int, dict[str, Any], TrainState]:
    """The newest checkpoint that reads back intact, as `(step, meta, state)` on
    `placement`; each damaged newer one is reported in a line and set aside."""
    steps = sorted(mgr.all_steps(), reverse=True)
    if not steps:
        raise UsageError(f"--resume: no checkpoint in {save_dir}.")
    for i, step in enumerate(steps):
        try:
            meta = read_meta(mgr, step)
            like = abstract_state(RunConfig(**meta["config"]), placement)
            state = restore_state(mgr, step, like, meta)
        except Damaged as e:
            older = steps[i + 1 :]
            then = f"falling back to step {older[0]}" if older else "no older one"
            say(f"warning: checkpoint {save_dir / str(step)} is damaged ({e}); {then}")
            continue
        for damaged in steps[:i]:
            set_aside(save_dir, damaged)
        if i:
            mgr.reload()
        return step, meta, state
    raise UsageError(
        f"--resume: no intact checkpoint in {save_dir} (steps "
        f"{', '.join(map(str, steps))} are all damaged)."
    )
