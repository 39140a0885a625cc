"""The training loop: settle the run (`prepare`), take its steps with logging,
evaluation and saving (`train`), and stop cleanly on a signal."""

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
import rich.console
import rich.progress
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

import eqx_remat
import eqx_remat as er
from benchmarks import _device

from .checkpointing import (
    find_resume_point,
    newest_meta,
    open_manager,
    save_checkpoint,
)
from .config import (
    FORMAT,
    USAGE,
    Flags,
    RunConfig,
    UsageError,
    check_extension,
    check_remat,
    learning_rate_schedule,
    mesh_spec,
    parse_args,
    run_config,
)
from .data import Corpus, corpus_for, sample
from .metrics import (
    PLOT_FILE,
    MetricsWriter,
    first_line,
    log_line,
    plot_losses,
    say,
)
from .model import (
    Placement,
    TrainState,
    eval_loss,
    init_state,
    make_optimizer,
    make_placement,
    step_flops,
    train_step,
)


class TrainResult(NamedTuple):
    """What `main` returns."""

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


def main(argv: Sequence[str] | None = None) -> TrainResult:
    """Train as the command line `argv` says (see `--help`). A bad flag exits with
    status 2; a bad combination of flags or checkpoint raises `UsageError`."""
    args = parse_args(argv)
    platform = _device.select_device(args, USAGE)
    # A new --save-dir is made once every flag is checked (a refused run writes none).
    exists = args.save_dir is not None and args.save_dir.exists()
    mgr = open_manager(args.save_dir, args.keep) if exists else None
    stop = StopRequest()  # a signal before the first step stops the run after it
    try:
        run, state = prepare(args, platform, mgr)
        if run.first >= run.last:  # --resume of a finished run: nothing to do
            say(
                f"train_lm.py: the run in {args.save_dir} is already at step "
                f"{run.first} of {run.c.steps}: nothing to train, nothing "
                "written (a larger --steps extends it)."
            )
            return TrainResult(state, [], run.first, None, False)
        if args.save_dir is not None and mgr is None:
            mgr = open_manager(args.save_dir, args.keep)
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


def cli() -> None:
    """`main`, with a `UsageError` as one `error:` line and exit status 2."""
    try:
        main()
    except UsageError as e:
        print(f"train_lm.py: error: {e}", file=sys.stderr)
        sys.exit(2)


def abandon(e: Exception, args: Flags) -> NoReturn:
    """End this process of a multi-process run now (not in JAX's shutdown, which
    waits for processes that are gone), with one line that says why, status 1."""
    me = f"process {jax.process_index()} of {jax.process_count()}"
    first = first_line(e)
    if isinstance(e, jax.errors.JaxRuntimeError):
        why = (
            f"{me}: a computation shared with the other processes failed ({first}): "
            "another process of the run has stopped or died; see its log."
        )
    else:
        traceback.print_exception(e)
        why = f"{me} failed ({type(e).__name__}: {first}); stopping every process."
    if args.save_dir is not None:
        why += " Continue from the last saved step with --resume --save-dir "
        why += f"{args.save_dir}."
    print(f"train_lm.py: error: {why}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def prepare(
    args: Flags, platform: str, mgr: ocp.CheckpointManager | None
) -> tuple[Run, TrainState]:
    """The run and its first state: with `--resume`, the newest intact
    checkpoint's, else a fresh one."""
    if mgr is not None and not args.resume and mgr.all_steps():
        raise UsageError(
            f"--save-dir {args.save_dir} already holds checkpoints (steps "
            f"{', '.join(map(str, mgr.all_steps()))}): add --resume to continue "
            "that run, or pick another directory."
        )
    saved = newest_meta(mgr) if args.resume else None
    c = run_config(args, saved and saved["config"], platform)
    spec = args.remat
    checkpoint = er.parse_checkpoint(spec, depth=c.layers)
    if saved is not None and "checkpoint" in saved:
        # The run continues as it was saved, unless --remat says otherwise.
        was = er.parse_checkpoint(saved["checkpoint"], depth=c.layers)
        if not args.remat_given:
            spec, checkpoint = er.checkpoint_label(was), was
        elif checkpoint != was:
            say(
                f"train_lm.py: --remat {spec}: the run continues with "
                f"{er.checkpoint_label(checkpoint)} (it was saved with "
                f"{er.checkpoint_label(was)})."
            )
    check_remat(spec, checkpoint, c.layers)
    placement = make_placement(mesh_spec(args.mesh), c.batch)
    corpus = corpus_for(c)
    if args.resume:
        step, meta, state = find_resume_point(mgr, args.save_dir, placement)
        c = run_config(args, meta["config"], platform)
        check_extension(RunConfig(**meta["config"]), c, step)
        if meta["corpus_sha256"] != corpus.sha256:
            raise UsageError(
                f"--resume: the corpus ({corpus.source}) differs from the "
                f"checkpoint's: sha256 {corpus.sha256[:12]} != "
                f"{meta['corpus_sha256'][:12]} (another Python's standard library, "
                "or changed --data?). Batches would not match."
            )
    else:
        state = init_state(c)
        state = state if placement is None else placement.params(state)
    # `--remat` changes memory and FLOPs only. As a static field of the model, it is
    # in the treedefs of the Adam moments too: set it in the whole state.
    state = eqx_remat.set_checkpoint(state, checkpoint)
    first = int(state.step)
    last = c.steps if args.stop_after is None else min(c.steps, first + args.stop_after)
    meta = dict(format=FORMAT, config=dataclasses.asdict(c))
    label = er.checkpoint_label(checkpoint)  # what a plain --resume reads back
    meta |= dict(corpus_sha256=corpus.sha256, checkpoint=label)
    optimizer = make_optimizer(c)
    run = Run(args, c, checkpoint, placement, corpus, optimizer, first, last, meta)
    return run, state


def describe(run: Run, state: TrainState) -> str:
    """The header: what is trained, on what, where; one line each."""
    c, n, p = run.c, run.n_devices, run.placement
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array)))
    sharding = "no sharding" if p is None else "FSDP" if p.fsdp else "data parallel"
    return (
        f"zoo.Transformer: {params:,} parameters, d_model {c.d_model}, "
        f"{c.layers} layers, {c.heads} heads\n"
        f"  batch {c.batch} x seq {c.seq}, {c.dtype}, "
        f"remat {er.checkpoint_label(run.checkpoint)}\n"
        f"  on {n} {_device.device_kind()} device{'s' * (n > 1)}, {sharding}\n"
        f"  data: {run.corpus.source}: {len(run.corpus.train):,} + "
        f"{len(run.corpus.val):,} held-out bytes\n"
        f"  steps {run.first} -> {run.last} of {c.steps}, "
        f"warmup {c.warmup}; metrics in {run.args.run_dir}"
    )


class StopRequest:
    """From its making: the first SIGTERM or SIGINT asks the loop to stop after its
    step, saved; a second one ends the process at once. With several processes,
    SIGTERM (and SIGINT, passed on as one) goes to JAX's preemption notifier, and
    every process stops after the same step."""

    def __init__(self) -> None:
        self.signum: int | None = None
        signals = [signal.SIGINT] + [signal.SIGTERM] * (jax.process_count() == 1)
        self.previous = {s: signal.signal(s, self._handle) for s in signals}

    def uninstall(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        for s in self.previous:
            signal.signal(s, signal.SIG_DFL)
        if jax.process_count() > 1:
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "preemption"

    def requested(self, step: int) -> bool:
        if self.signum is not None or jax.process_count() == 1:
            return self.signum is not None
        return multihost_utils.reached_preemption_sync_point(step)


def train(
    run: Run, state: TrainState, mgr: ocp.CheckpointManager | None, stop: StopRequest
) -> TrainResult:
    """Steps `run.first` to `run.last`, then the closing lines and the plot."""
    main_process = _device.is_main_process()
    writer = MetricsWriter(run.args.run_dir, run.first) if main_process else None
    say(describe(run, state))
    try:
        state, losses, stopped_by, final_eval = _loop(run, state, mgr, stop, writer)
    finally:
        if writer is not None:
            writer.close()
    done, c, save_dir = run.first + len(losses), run.c, run.args.save_dir
    where = "nothing saved (no --save-dir)"
    if saved := mgr is not None:
        mgr.wait_until_finished()
        where = f"saved step {done} to {save_dir}"
    if stopped_by is None:
        say(f"step {done} of {c.steps}: {where}")
    else:
        again = f"; continue with --resume --save-dir {save_dir}" if saved else ""
        say(f"{stopped_by}: stopped after step {done} of {c.steps}; {where}{again}")
    if final_eval is not None:
        bits = final_eval / math.log(2)
        say(f"held-out loss {final_eval:.4f} ({bits:.3f} bits/byte) after {done} steps")
    if writer is not None:
        plot_losses(writer.path, run.args.run_dir / PLOT_FILE)
        say(f"loss curve: {run.args.run_dir / PLOT_FILE}")
    losses = [float(x) for x in losses]
    return TrainResult(state, losses, run.first, final_eval, done < c.steps)


def _loop(run, state, mgr, stop, writer):
    """The steps: `(state, losses, stopped_by, final held-out loss)`. A line's
    step time leaves out the invocation's first step (it compiles), evaluation
    and saving."""
    args, c = run.args, run.c
    flops = (None, None)
    if _device.peak_flops_per_chip() is not None:  # else MFU is null anyway
        tokens = jax.ShapeDtypeStruct((c.batch, c.seq + 1), jnp.int32)
        flops = step_flops(state, tokens, run.optimizer)
    started = tick = time.perf_counter()
    losses, since, timed, seconds = [], run.first, 0, 0.0
    final_eval = stopped_by = None
    with _progress(args) as bar:
        task = bar.add_task("compiling", total=c.steps, completed=run.first, loss="-")
        for step in range(run.first, run.last):
            batch = (_batch(run, run.corpus.train, (c.seed, 0, step)), jnp.int32(step))
            loss, state = train_step(batch, state, run.optimizer, run.placement)
            losses.append(loss)
            done = step + 1
            if step > run.first:
                timed += 1
            else:  # compiled: the clock starts now
                jax.block_until_ready(loss)
                tick = time.perf_counter()
                bar.update(task, description="train")
            stopping = stop.requested(done)
            logging = done == run.last or _every(done, args.log_every)
            logging = logging or _every(done, args.eval_every)
            saving = stopping or done == run.last or _every(done, args.save_every)
            saving = saving and mgr is not None
            if logging or saving:
                jax.block_until_ready((loss, state))
                seconds += time.perf_counter() - tick
            if logging:
                step_s = seconds / timed if timed else None
                window = [float(x) for x in losses[since - run.first :]]
                row = _row(run, state, done, window, step_s, flops, started)
                final_eval = row["eval_loss"] if done == c.steps else final_eval
                if writer is not None:
                    writer.write(row)
                say(log_line(row))
                bar.update(task, loss=f"{row['loss']:.4f}")
                since, timed, seconds = done, 0, 0.0
            if saving:
                save_checkpoint(mgr, done, state, run.meta)
            if logging or saving:
                tick = time.perf_counter()
            bar.update(task, completed=done)
            if stopping:
                stopped_by = stop.name
                break
    return state, losses, stopped_by, final_eval


def _every(step: int, n: int) -> bool:
    return n > 0 and step % n == 0


def _progress(args: Flags) -> rich.progress.Progress:
    bar = rich.progress
    columns = ("[bold]{task.description}", bar.BarColumn(), bar.MofNCompleteColumn())
    columns += (bar.TimeElapsedColumn(), bar.TimeRemainingColumn())
    disable = args.no_progress or not _device.is_main_process()
    loss = "loss {task.fields[loss]}"
    return bar.Progress(*columns, loss, console=rich.console.Console(), disable=disable)


def _batch(run: Run, data, seed: tuple[int, ...]) -> jax.Array:
    """The batch of `seed`, split over the mesh by rows if any (each process
    reading only its devices' rows)."""
    read = lambda rows=slice(None): sample(data, run.c.seq, run.c.batch, seed, rows)
    if run.placement is None:
        return read()
    sharding = NamedSharding(run.placement.mesh, PartitionSpec("data", None))
    shape = (run.c.batch, run.c.seq + 1)
    return jax.make_array_from_callback(shape, sharding, lambda i: read(i[0]))


def _row(run, state, done, window, step_s, flops, started) -> dict[str, Any]:
    """The metrics line of step `done`: `window` holds the losses since the last."""
    args, c = run.args, run.c
    eval_due = args.eval_batches and (done == c.steps or _every(done, args.eval_every))
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


def held_out_loss(run: Run, transformer: eqx.Module) -> float:
    """The mean loss of `--eval-batches` batches of the held-out bytes."""
    n, seed = run.args.eval_batches, run.c.seed
    val = (_batch(run, run.corpus.val, (seed, 1, i)) for i in range(n))
    return sum(float(eval_loss(transformer, tokens)) for tokens in val) / n
