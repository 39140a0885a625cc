"""Orbax checkpoints of a `TrainState`, their integrity, and resuming from the
newest intact one.

The checkpoint of step N is the directory SAVE_DIR/N with two items: `state`,
the arrays of `eqx.partition(state, eqx.is_array)` as an Orbax pytree (each host
writes the shards it owns; Orbax's own metadata describes every array) and
`meta`, a JSON object with the run's options and `sha256`: the SHA-256 of the
arrays' bytes per process, taken at save time. Restoring fills a pytree of
`jax.ShapeDtypeStruct`s that carry the shardings of this run, then recomputes the
hashes: a checkpoint that cannot be read, or reads back different bytes, is
damaged and never used."""

import asyncio
import contextlib
import hashlib
import logging
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from benchmarks import _device

from .config import FORMAT, RunConfig, UsageError
from .model import TrainState


log = logging.getLogger("train_lm")


class Damaged(Exception):
    """A checkpoint that cannot be read or does not match its content hash."""


def content_sha256(arrays: Any) -> str:
    """SHA-256 of the bytes this process holds of every array of `arrays`, with
    their pytree paths: a whole array when this process can see all of it (one
    host, any mesh), else its shards of replica 0 with their index (the shards
    this host writes; the same again after restoring into the same shardings)."""
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_leaves_with_path(arrays):
        h.update(jax.tree_util.keystr(path).encode())
        if x.is_fully_addressable:
            h.update(np.ascontiguousarray(jax.device_get(x)).tobytes())
            continue
        shards = [s for s in x.addressable_shards if s.replica_id == 0]
        for s in sorted(shards, key=lambda s: repr(s.index)):
            h.update(repr(s.index).encode())
            h.update(np.ascontiguousarray(jax.device_get(s.data)).tobytes())
    return h.hexdigest()


def all_processes(digest: str) -> list[str]:
    """Every process's `digest`, in process order (one collective)."""
    if jax.process_count() == 1:
        return [digest]
    mine = np.frombuffer(bytes.fromhex(digest), dtype=np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(mine))
    return [bytes(row).hex() for row in gathered.reshape(jax.process_count(), -1)]


def open_manager(save_dir: Path, keep: int) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        enable_async_checkpointing=True,
        create=True,
        # Not `cleanup_tmp_directories`: it runs in a thread that close() does not
        # join, and fails at exit. The unfinished save of a second Ctrl-C is
        # ignored by Orbax, and replaced when that step is saved again.
    )
    return ocp.CheckpointManager(save_dir.absolute(), options=options)


def save_checkpoint(
    mgr: ocp.CheckpointManager, step: int, state: TrainState, meta: dict[str, Any]
) -> None:
    """Start saving `state` as step `step` (asynchronously: Orbax copies the arrays
    to the host, then writes them in the background)."""
    arrays = eqx.filter(state, eqx.is_array)
    meta = {**meta, "step": step, "sha256": all_processes(content_sha256(arrays))}
    mgr.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
        ),
        force=True,
    )


def read_meta(mgr: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    try:
        with settled_reads():
            meta = mgr.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
        meta = meta["meta"]
    except Exception as e:
        raise Damaged(_one_line(e)) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise Damaged(f"expected a JSON item of format {FORMAT!r}")
    missing = {"config", "corpus_sha256", "sha256"} - set(meta)
    if missing:
        raise Damaged(f"its JSON item lacks {', '.join(sorted(missing))}")
    try:
        RunConfig(**meta["config"])
    except TypeError as e:
        raise Damaged(f"its JSON item has other run options: {e}") from None
    return meta


def restore_state(
    mgr: ocp.CheckpointManager, step: int, like: TrainState, meta: dict[str, Any]
) -> TrainState:
    """The `TrainState` of step `step`, into the shapes, dtypes and shardings of
    `like` (`jax.ShapeDtypeStruct`s), checked against its content hash."""
    is_struct = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    arrays, static = eqx.partition(like, is_struct)
    try:
        with settled_reads():
            restored = mgr.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(arrays))
            )["state"]
        for a, b in zip(
            jax.tree.leaves(restored), jax.tree.leaves(arrays), strict=True
        ):
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                raise Damaged(
                    f"expected an array {b.dtype}{list(b.shape)}. "
                    f"Got {a.dtype}{list(a.shape)}"
                )
    except Damaged:
        raise
    except Exception as e:
        raise Damaged(_one_line(e)) from None
    expected = meta.get("sha256")
    if not isinstance(expected, list) or len(expected) != jax.process_count():
        raise Damaged(
            f"its content hash is missing or for another process count "
            f"({jax.process_count()} processes now)"
        )
    ok = content_sha256(restored) == expected[jax.process_index()]
    if jax.process_count() > 1:  # every host falls back together
        ok = bool(np.all(multihost_utils.process_allgather(np.int32(ok))))
    if not ok:
        raise Damaged("its arrays do not match the SHA-256 recorded when it was saved")
    return eqx.combine(restored, static)


# Orbax restores every array in one `asyncio.gather` of per-array reads, on an
# event loop it makes for the restore and closes when the gather returns. When
# one read fails (a damaged file), the gather raises at once and the loop is
# closed while the other reads are still in flight: they finish later on a closed
# loop, and Python reports each of them ("Task exception was never retrieved",
# "RuntimeError: Event loop is closed") after our one-line warning. So during a
# restore every new event loop settles what it started before it closes.

SETTLE_S = 60.0  # at most this long for the reads in flight, then cancelled


class _SettlingLoop(asyncio.SelectorEventLoop):
    """An event loop that, when closed, first lets the tasks still running on it
    finish (cancelling those not done within `SETTLE_S`), and so retrieves their
    results and exceptions."""

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


def _one_line(e: BaseException) -> str:
    text = (str(e) or type(e).__name__).strip().splitlines()[0]
    text = text.split(" See full TensorStore details")[0]  # a repr of a method
    return f"{type(e).__name__}: {text[:200]}"


def set_aside(save_dir: Path, step: int) -> None:
    """Move a damaged checkpoint out of the manager's way (Orbax ignores a
    directory whose name is not a step), so the resumed run can save that step
    again; its bytes stay for inspection."""
    if _device.is_main_process():
        target = save_dir / f"damaged-{step}"
        if target.exists():
            shutil.rmtree(target)
        (save_dir / str(step)).rename(target)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("train_lm: set aside")


def newest_meta(mgr: ocp.CheckpointManager) -> dict[str, Any] | None:
    """The JSON item of the newest checkpoint whose JSON item reads back (the
    run's options, before any array is restored), or `None`."""
    for step in sorted(mgr.all_steps(), reverse=True):
        try:
            return read_meta(mgr, step)
        except Damaged:
            continue  # reported by find_resume_point
    return None


def find_resume_point(
    mgr: ocp.CheckpointManager,
    save_dir: Path,
    like_for: Callable[[dict[str, Any]], TrainState],
) -> tuple[int, dict[str, Any], TrainState]:
    """The newest checkpoint that reads back intact: `(step, meta, state)`.
    `like_for(meta)` gives the abstract state to restore into. Damaged ones are
    reported in one line each and set aside."""
    steps = sorted(mgr.all_steps(), reverse=True)
    if not steps:
        raise UsageError(f"--resume: no checkpoint in {save_dir}.")
    damaged: list[int] = []
    for step in steps:
        try:
            meta = read_meta(mgr, step)
            state = restore_state(mgr, step, like_for(meta), meta)
        except Damaged as e:
            damaged.append(step)
            older = [s for s in steps if s < step]
            then = f"falling back to step {older[0]}" if older else "no older one"
            log.warning(f"checkpoint {save_dir / str(step)} is damaged ({e}); {then}")
            continue
        for bad in damaged:
            set_aside(save_dir, bad)
        if damaged:
            mgr.reload()
        return step, meta, state
    raise UsageError(
        f"--resume: no intact checkpoint in {save_dir} (steps "
        f"{', '.join(map(str, damaged))} are all damaged)."
    )
