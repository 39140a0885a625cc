"""The training loop: settle the run (`prepare`), take its steps with logging,
evaluation and saving (`train`), and report where it stopped."""

import dataclasses
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

import eqx_remat
from benchmarks import _common, _device

from . import checkpointing
from .config import (
    FORMAT,
    Flags,
    RunConfig,
    Usage,
    UsageError,
    check_config,
    check_extension,
    check_remat,
    learning_rate_schedule,
    mesh_spec,
    parse_args,
    run_config,
)
from .data import Corpus, corpus_for, sample
from .metrics import PLOT_FILE, MetricsWriter, log, log_line, plot_losses, setup_logging
from .model import (
    Placement,
    TrainState,
    abstract_state,
    eval_loss,
    init_state,
    make_optimizer,
    make_placement,
    step_flops,
    train_step,
)


class TrainResult(NamedTuple):
    """What `main` returns (for tests and notebooks)."""

    state: TrainState
    losses: list[float]  # the training loss of each step of this invocation
    first_step: int  # the step number of `losses[0]`
    eval_loss: float | None  # the final held-out loss, if computed
    stopped: bool  # by a signal or --stop-after, before --steps


class Run(NamedTuple):
    """What the loop needs, settled before its first step."""

    args: Flags
    c: RunConfig
    checkpoint: eqx_remat.Checkpoint
    placement: Placement | None
    corpus: Corpus
    optimizer: optax.GradientTransformation
    first: int  # the first step of this invocation
    last: int  # the step after which it stops
    meta: dict[str, Any]  # the JSON item of its checkpoints, without the step

    @property
    def n_devices(self) -> int:
        return 1 if self.placement is None else self.placement.mesh.size


def main(argv: Sequence[str] | None = None, doc: str | None = None) -> TrainResult:
    """Train as the command line `argv` says (see `--help`)."""
    from . import __doc__ as package_doc

    args = parse_args(argv, doc or package_doc)
    platform = _device.select_device(args, Usage())
    setup_logging()
    # A --save-dir that does not exist yet is made once every flag is checked
    # (`prepare`): a run refused for its flags leaves nothing behind.
    made_later = args.save_dir is not None and not args.save_dir.exists()
    opened = args.save_dir is not None and not made_later
    mgr = checkpointing.open_manager(args.save_dir, args.keep) if opened else None
    stop = StopRequest()
    stop.install()  # a signal before the first step stops the run after it
    try:
        run, state = prepare(args, platform, mgr)
        if made_later:
            mgr = checkpointing.open_manager(args.save_dir, args.keep)
        return train(run, state, mgr, stop)
    except Exception as e:
        if jax.process_count() > 1 and not isinstance(e, UsageError):
            abandon(e, args)
        raise
    finally:
        stop.uninstall()
        if mgr is not None:
            mgr.wait_until_finished()
            mgr.close()


def cli(argv: Sequence[str] | None = None) -> None:
    """`main`, with a bad command line or checkpoint as one `error:` line, rc 2:
    `python benchmarks/train_lm.py` and `python -m benchmarks.train`."""
    try:
        main(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"train_lm.py: error: {e}", file=sys.stderr)
        sys.exit(2)


def abandon(e: Exception, args: Flags) -> NoReturn:
    """End this process of a multi-process run that cannot go on: one line that
    says why, then exit 1 at once. A failed collective means another process has
    stopped or died; any other error is this process's own (its traceback comes
    first), and exiting at once ends the run on the other processes too (their
    next collective fails, or at the latest JAX's coordination service takes
    this one as gone after `--heartbeat-timeout` and aborts them), where
    waiting for JAX's orderly shutdown would wait for processes that are gone."""
    me = f"process {jax.process_index()} of {jax.process_count()}"
    first = _common.first_line(e)
    resume = (
        f" Continue from the last saved step with --resume --save-dir {args.save_dir}."
        if args.save_dir is not None
        else ""
    )
    if isinstance(e, jax.errors.JaxRuntimeError):
        why = (
            f"{me}: a computation shared with the other processes failed ({first}): "
            "another process of the run has stopped or died; see its log."
        )
    else:
        traceback.print_exception(e)
        why = f"{me} failed ({type(e).__name__}: {first}); stopping every process."
    print(f"train_lm.py: error: {why}{resume}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


# ---------------------------------------------------------------------------- setup


def prepare(
    args: Flags, platform: str, mgr: ocp.CheckpointManager | None
) -> tuple[Run, TrainState]:
    """The run and its first state: restored with `--resume`, else fresh."""
    if mgr is not None and not args.resume and mgr.all_steps():
        raise UsageError(
            f"--save-dir {args.save_dir} already holds checkpoints (steps "
            f"{', '.join(map(str, mgr.all_steps()))}): add --resume to continue "
            "that run, or pick another directory."
        )
    saved = checkpointing.newest_meta(mgr) if args.resume else None
    c = run_config(args, saved and saved["config"], platform)
    check_config(c)
    checkpoint = _common.parse_checkpoint(args.remat, depth=c.layers)
    check_remat(args.remat, checkpoint, c.layers)
    placement = make_placement(mesh_spec(args.mesh), c.batch)
    corpus = corpus_for(c)
    if args.resume:
        c, state = resume(args, mgr, placement, corpus, platform)
    else:
        state = init_state(c)
        if placement is not None:
            state = placement.params(state)
    # `checkpoint` is not part of the run: it changes memory and FLOPs only. It is a
    # static field, so it is also in the treedef of the Adam moments (pytrees shaped
    # like the model): replace it in the whole state, not just in the model.
    state = eqx_remat.set_checkpoint(state, checkpoint)
    first = int(state.step)
    last = c.steps if args.stop_after is None else min(c.steps, first + args.stop_after)
    meta = {
        "format": FORMAT,
        "config": dataclasses.asdict(c),
        "corpus_sha256": corpus.sha256,
        "checkpoint": repr(checkpoint),
    }
    optimizer = make_optimizer(c)
    run = Run(args, c, checkpoint, placement, corpus, optimizer, first, last, meta)
    return run, state


def resume(
    args: Flags,
    mgr: ocp.CheckpointManager,
    placement: Placement | None,
    corpus: Corpus,
    platform: str,
) -> tuple[RunConfig, TrainState]:
    """The newest intact checkpoint's state, and the run's `RunConfig` checked
    against it."""
    like_for = lambda meta: abstract_state(RunConfig(**meta["config"]), placement)
    step, meta, state = checkpointing.find_resume_point(mgr, args.save_dir, like_for)
    c = run_config(args, meta["config"], platform)
    check_config(c)
    check_extension(RunConfig(**meta["config"]), c, step)
    if meta["corpus_sha256"] != corpus.sha256:
        raise UsageError(
            f"--resume: the corpus ({corpus.source}) differs from the checkpoint's: "
            f"sha256 {corpus.sha256[:12]} != {meta['corpus_sha256'][:12]} (another "
            "Python's standard library, or changed --data?). Batches would not match."
        )
    return c, state


def describe(run: Run, state: TrainState) -> str:
    """The header: what is trained, on what, where, and where metrics go; one
    line each (80 columns, a long path aside)."""
    c, p, n = run.c, run.placement, run.n_devices
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array)))
    devices = f"{n} {_device.device_kind()} device{'s' if n > 1 else ''}"
    if p is None:
        devices += ", no sharding"
    else:
        devices += ", FSDP" if p.fsdp else ", data parallel"
    return "\n".join(
        [
            f"zoo.Transformer: {params:,} parameters, d_model {c.d_model}, "
            f"{c.layers} layers, {c.heads} heads",
            f"  batch {c.batch} x seq {c.seq}, {c.dtype}, "
            f"remat {_common.checkpoint_label(run.checkpoint)}",
            f"  on {devices}",
            f"  data: {run.corpus.source}: {len(run.corpus.train):,} + "
            f"{len(run.corpus.val):,} held-out bytes",
            f"  steps {run.first} -> {run.last} of {c.steps}, "
            f"warmup {c.warmup}; metrics in {run.args.run_dir}",
        ]
    )


def model_flops(run: Run, state: TrainState) -> tuple[int | None, int | None]:
    """`(model, hardware)` FLOPs of a step, for MFU and HFU; `None` where the
    device's peak FLOP/s is unknown (the CPU), as MFU is then `null` anyway."""
    if _device.peak_flops_per_chip() is None:
        return None, None
    tokens = jax.ShapeDtypeStruct((run.c.batch, run.c.seq + 1), jnp.int32)
    return step_flops(state, tokens, run.optimizer)


# ---------------------------------------------------------------------- preemption
# SIGTERM and Ctrl-C stop the run after the current step, saved. With several
# processes (`--distributed`), SIGTERM to any one of them (a slice's preemption
# reaches every host; here one is enough) is caught by JAX's preemption notifier,
# which tells every process; they agree on a step to stop after
# (`multihost_utils.reached_preemption_sync_point`), save it together and exit 0.


class StopRequest:
    """SIGTERM / SIGINT: the first asks the loop to finish its step, save and exit
    0; the handler then gives the signal back to the operating system, so a second
    one ends the process at once (even inside a compile), without saving."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}

    def install(self) -> None:
        signals = [signal.SIGINT]
        if jax.process_count() == 1:
            # On a multi-host slice, SIGTERM (preemption) reaches JAX's preemption
            # notifier, and the hosts agree on a step (`reached_preemption_sync_point`).
            signals.append(signal.SIGTERM)
        for s in signals:
            self.previous[s] = signal.signal(s, self._handle)

    def uninstall(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        for s in self.previous:
            signal.signal(s, signal.SIG_DFL)
        if jax.process_count() > 1:
            # Ctrl-C on one process of several: handed to JAX's preemption
            # notifier as a SIGTERM, so that every process stops after one step.
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.signum = signum

    @property
    def name(self) -> str:
        """What stopped the run, for its closing line."""
        return signal.Signals(self.signum).name if self.signum else "preemption"

    def requested(self, step: int) -> bool:
        if self.signum is not None or jax.process_count() == 1:
            return self.signum is not None
        return multihost_utils.reached_preemption_sync_point(step)


# ----------------------------------------------------------------------------- loop


class Clock:
    """Times the steps since the last logged line: of them, `timed` ran after the
    first step of the invocation (which compiles), in `seconds` (evaluation and
    saving excluded)."""

    def __init__(self, start: int) -> None:
        self.start, self.timed, self.seconds = start, 0, 0.0
        self.compiled = False
        self.tick = time.perf_counter()

    def stepped(self, loss: jax.Array) -> bool:
        """Count a step; `True` after the first one (once compiled)."""
        if self.compiled:
            self.timed += 1
            return False
        jax.block_until_ready(loss)
        self.compiled = True
        self.tick = time.perf_counter()
        return True

    def pause(self) -> None:
        self.seconds += time.perf_counter() - self.tick

    def go(self) -> None:
        self.tick = time.perf_counter()

    def restart(self, start: int) -> None:
        self.start, self.timed, self.seconds = start, 0, 0.0

    @property
    def step_s(self) -> float | None:
        return self.seconds / self.timed if self.timed else None


def train(
    run: Run, state: TrainState, mgr: ocp.CheckpointManager | None, stop: StopRequest
) -> TrainResult:
    """Steps `run.first` to `run.last`, then the closing lines and the plot."""
    main_process = _device.is_main_process()
    writer = MetricsWriter(run.args.run_dir, run.first) if main_process else None
    log.info(describe(run, state))
    try:
        state, losses, stopped_by, final_eval = _loop(run, state, mgr, stop, writer)
    finally:
        if writer is not None:
            writer.close()
    done = run.first + len(losses)
    if mgr is not None:
        mgr.wait_until_finished()
    _report(run, done, stopped_by, final_eval, saved=mgr is not None)
    if writer is not None:
        plot_losses(writer.path, run.args.run_dir / PLOT_FILE)
        log.info(f"loss curve: {run.args.run_dir / PLOT_FILE}")
    losses = [float(x) for x in losses]
    return TrainResult(state, losses, run.first, final_eval, done < run.c.steps)


def _loop(run, state, mgr, stop, writer):
    """The steps; returns `(state, losses, stopped_by, final held-out loss)`."""
    args, c = run.args, run.c
    flops = model_flops(run, state)
    started = time.perf_counter()
    losses: list[jax.Array] = []
    clock, final_eval, stopped_by = Clock(run.first), None, None
    with _progress(args) as progress:
        task = progress.add_task(
            "compiling", total=c.steps, completed=run.first, loss="-"
        )
        for step in range(run.first, run.last):
            loss, state = _step(run, state, step)
            losses.append(loss)
            done = step + 1
            if clock.stepped(loss):
                progress.update(task, description="train")
            stopping = stop.requested(done)
            logging_due = _every(done, args.log_every) or done == run.last
            logging_due = logging_due or _every(done, args.eval_every)
            save_due = mgr is not None and (
                _every(done, args.save_every) or done == run.last or stopping
            )
            if logging_due or save_due:  # stop the clock: eval and saving
                jax.block_until_ready((loss, state))  # do not count
                clock.pause()
            if logging_due:
                row = _row(run, state, done, losses, clock, flops, started)
                final_eval = row["eval_loss"] if done == c.steps else final_eval
                if writer is not None:
                    writer.write(row)
                log.info(log_line(row))
                progress.update(task, loss=f"{row['loss']:.4f}")
                clock.restart(done)
            if save_due:
                checkpointing.save_checkpoint(mgr, done, state, run.meta)
            if logging_due or save_due:
                clock.go()
            progress.update(task, completed=done)
            if stopping:
                stopped_by = stop.name
                break
    return state, losses, stopped_by, final_eval


def _every(step: int, n: int) -> bool:
    return n > 0 and step % n == 0


def _progress(args: Flags) -> Progress:
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("loss {task.fields[loss]}"),
    )
    disable = args.no_progress or not _device.is_main_process()
    return Progress(*columns, console=Console(), disable=disable)


def _batch(run: Run, data, seed: tuple[int, ...]):
    """The batch of `seed`: read whole on one device, else split over the mesh,
    each process reading only its devices' rows."""
    c = run.c
    if run.placement is None:
        return sample(data, c.seq, c.batch, seed)
    read = lambda rows: sample(data, c.seq, c.batch, seed, rows)
    return run.placement.batch_from(read, (c.batch, c.seq + 1))


def _step(run: Run, state: TrainState, step: int) -> tuple[jax.Array, TrainState]:
    tokens = _batch(run, run.corpus.train, (run.c.seed, 0, step))
    return train_step((tokens, jnp.int32(step)), state, run.optimizer, run.placement)


def held_out_loss(run: Run, model) -> float:
    """The mean loss of `--eval-batches` batches of the held-out bytes."""
    c, total = run.c, 0.0
    for i in range(run.args.eval_batches):
        tokens = _batch(run, run.corpus.val, (c.seed, 1, i))
        total += float(eval_loss(model, tokens))
    return total / run.args.eval_batches


def _row(run, state, done, losses, clock, flops, started) -> dict[str, Any]:
    """The metrics of the steps since the previous line (see `metrics.jsonl`)."""
    args, c = run.args, run.c
    eval_due = args.eval_batches and (done == c.steps or _every(done, args.eval_every))
    window = [float(x) for x in losses[clock.start - run.first :]]
    step_s = clock.step_s
    with jax.numpy_dtype_promotion("standard"):
        lr = float(learning_rate_schedule(c)(done - 1))
    return {
        "step": done,
        "loss": window[-1],
        "loss_avg": sum(window) / len(window),
        "eval_loss": held_out_loss(run, state.model) if eval_due else None,
        "lr": lr,
        "tokens_per_s": c.batch * c.seq / step_s if step_s else None,
        "step_s": step_s,
        "peak_bytes": _device.peak_bytes_in_use(),
        "mfu": _device.utilisation(flops[0], step_s, devices=run.n_devices),
        "hfu": _device.utilisation(flops[1], step_s, devices=run.n_devices),
        "wall_s": round(time.perf_counter() - started, 3),
        "time": time.time(),
    }


def _report(run: Run, done: int, stopped_by: str | None, final_eval, saved: bool):
    """The closing lines: where the run stopped, what was saved, the loss."""
    c, save_dir = run.c, run.args.save_dir
    where = (
        f"saved step {done} to {save_dir}" if saved else "nothing saved (no --save-dir)"
    )
    if stopped_by is not None:
        log.info(
            f"{stopped_by}: stopped after step {done} of {c.steps}; {where}"
            + (f"; continue with --resume --save-dir {save_dir}" if saved else "")
        )
    else:
        log.info(f"step {done} of {c.steps}: {where}")
    if final_eval is not None:
        log.info(
            f"held-out loss {final_eval:.4f} "
            f"({final_eval / math.log(2):.3f} bits/byte) after {done} steps"
        )
