"""benchmarks/train_lm.py (the package benchmarks/train/): it learns; it survives
SIGTERM, damaged checkpoints and bad flags; it resumes bit for bit; the remat
schedule changes nothing but memory and FLOPs.

Compiles are slow on two cores, so one compiled step serves most tests: runs of
the same `RunConfig` in this process share it (the script caches its optimiser).
What must be seen from outside (return codes, one-line errors, signals) runs the
script in a subprocess, before any compile where it can."""

import contextlib
import gc
import hashlib
import io
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

import benchmarks.train_lm as train_lm
import eqx_remat
from benchmarks import _device
from benchmarks.train import checkpointing, config, model as train_model


SCRIPT = Path(train_lm.__file__)
# On one device, explicitly: the tests run with 8 CPU devices (conftest.py), and
# `--mesh auto` would use them all.
TINY = [
    "--seed", "0", "--steps", "8", "--batch", "4", "--seq", "32", "--d-model",
    "32", "--heads", "2", "--layers", "3", "--lr", "3e-3", "--warmup", "2",
    "--data-bytes", "200000", "--log-every", "4", "--save-every", "4",
    "--eval-batches", "0", "--no-progress", "--mesh", "none",
]  # fmt: skip


def arrays(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def assert_same_state(a, b):
    for x, y in zip(arrays(a), arrays(b), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def metrics(save_dir: Path) -> list[dict]:
    lines = (save_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the TensorBoard event files in `run_dir`, by tag: `(step,
    value)` in file order. Each file is read as the TFRecords it is (length, its
    masked CRC-32C, an `Event` protocol buffer, the buffer's CRC), with the
    writer package's own protocol buffers and checksum."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            header, (length_crc,) = (
                data[i : i + 8],
                struct.unpack_from("<I", data, i + 8),
            )
            assert masked_crc32c(header) == length_crc, path
            (n,) = struct.unpack("<Q", header)
            body, (body_crc,) = (
                data[i + 12 : i + 12 + n],
                struct.unpack_from("<I", data, i + 12 + n),
            )
            assert masked_crc32c(body) == body_crc, path
            event = Event.FromString(body)
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
            i += 16 + n
    return out


def script(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def meta(save_dir: Path, step: int) -> dict:
    return json.loads((save_dir / str(step) / "meta" / "metadata").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Eight steps in one go, under `"dots"`, saved at steps 4 and 8."""
    save_dir = tmp_path_factory.mktemp("uninterrupted")
    result = train_lm.main([*TINY, "--remat", "dots", "--save-dir", str(save_dir)])
    return result, save_dir


@pytest.mark.heavy
def test_loss_decreases(uninterrupted):
    result, _ = uninterrupted
    losses = result.losses
    assert len(losses) == 8 and result.first_step == 0 and not result.stopped
    assert all(np.isfinite(losses))
    # Byte-level: the loss starts near ln(256) = 5.55 and learns the byte
    # frequencies within a few steps.
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.3, losses


def test_checkpoints_and_metrics(uninterrupted):
    result, save_dir = uninterrupted
    names = sorted(p.name for p in save_dir.iterdir())
    assert len(names) == 5 and names[2].startswith("events.out.tfevents."), names
    assert names[:2] + names[3:] == ["4", "8", "loss.png", "metrics.jsonl"]
    assert (save_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = metrics(save_dir)
    assert [r["step"] for r in rows] == [4, 8]
    assert [r["loss"] for r in rows] == [result.losses[3], result.losses[7]]
    assert rows[1]["loss_avg"] == pytest.approx(np.mean(result.losses[4:]), rel=1e-6)
    for r in rows:
        assert r["eval_loss"] is None and r["lr"] > 0 and r["wall_s"] > 0
        # The first line times steps 2-4 only: step 1 compiled.
        assert r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_s"], rel=1e-9)
        # The CPU reports neither peak memory nor a peak FLOP/s.
        assert r["peak_bytes"] is None and r["mfu"] is None and r["hfu"] is None
    # The same figures as TensorBoard scalars (float32), at the same steps.
    logged = scalars(save_dir)
    assert logged["loss/train"] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows
    ]
    assert logged["loss/train_avg"] == [
        (r["step"], pytest.approx(r["loss_avg"], rel=1e-6)) for r in rows
    ]
    assert [s for s, _ in logged["optimizer/lr"]] == [4, 8]
    assert "loss/held_out" not in logged and "speed/mfu" not in logged  # null
    m = meta(save_dir, 8)
    assert m["step"] == 8 and m["config"]["steps"] == 8 and len(m["sha256"]) == 1
    assert m["sha256"][0] == checkpointing.content_sha256(
        eqx.filter(result.state, eqx.is_array)
    )


@pytest.mark.heavy
def test_sigterm_then_resume_is_bit_identical(uninterrupted, tmp_path):
    """SIGTERM during the first step's compile: the step finishes, is saved, one
    line says so, rc 0. `--resume` then ends where the uninterrupted run ended:
    the same losses in metrics.jsonl, the same parameters and optimiser state."""
    result, reference = uninterrupted
    with subprocess.Popen(
        [sys.executable, str(SCRIPT), *TINY, "--save-dir", str(tmp_path)],
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        header = proc.stderr.readline()
        assert header.startswith("zoo.Transformer:"), header
        proc.send_signal(signal.SIGTERM)  # handled once the compile returns
        rest = proc.stderr.read()
        assert proc.wait(timeout=300) == 0, rest
    lines = rest.splitlines()
    assert all(line.startswith("  ") for line in lines[:4]), rest  # the header
    assert lines[4:] == [
        f"SIGTERM: stopped after step 1 of 8; saved step 1 to {tmp_path}; continue "
        f"with --resume --save-dir {tmp_path}",
        f"loss curve: {tmp_path / 'loss.png'}",
    ]
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [1]

    resumed = train_lm.main(["--resume", "--save-dir", str(tmp_path), "--no-progress",
                             "--log-every", "4", "--eval-batches", "0",
                             "--mesh", "none"])  # fmt: skip
    assert resumed.first_step == 1 and resumed.losses == result.losses[1:]
    assert metrics(tmp_path)[-1]["loss"] == metrics(reference)[-1]["loss"]
    assert [r["step"] for r in metrics(tmp_path)] == [4, 8]
    assert_same_state(resumed.state, result.state)
    assert meta(tmp_path, 8)["sha256"] == meta(reference, 8)["sha256"]


@pytest.mark.heavy
def test_stop_after_then_extend_is_bit_identical(uninterrupted, tmp_path):
    """A 6-step run stopped in its warmup is extended to 8 steps: the learning
    rates so far are those of an 8-step run, so it ends as the 8-step run does."""
    result, _ = uninterrupted
    args = [*TINY, "--save-dir", str(tmp_path)]
    first = train_lm.main([*args, "--steps", "6", "--stop-after", "2"])
    assert first.stopped and first.losses == result.losses[:2]
    second = train_lm.main(
        ["--resume", "--mesh", "none", "--steps", "8", *args[-2:], "--no-progress"]
    )
    assert second.first_step == 2 and second.losses == result.losses[2:]
    assert_same_state(second.state, result.state)


def test_resuming_a_finished_run_does_nothing(uninterrupted, tmp_path, capsys):
    """`--resume` of a run already at its last step says so and stops: no step,
    no compile, no checkpoint saved again, no TensorBoard file added."""
    result, reference = uninterrupted
    save_dir = tmp_path / "run"
    shutil.copytree(reference, save_dir)
    before = {p.name: p.stat().st_mtime_ns for p in save_dir.rglob("*")}
    capsys.readouterr()
    again = train_lm.main(["--resume", "--mesh", "none", "--save-dir", str(save_dir)])
    assert again.losses == [] and again.first_step == 8 and not again.stopped
    assert_same_state(again.state, result.state)
    assert {p.name: p.stat().st_mtime_ns for p in save_dir.rglob("*")} == before
    err = capsys.readouterr().err
    assert "already at step 8 of 8: nothing to train" in err, err


def test_help_says_the_warmup_default_rule():
    """`--help` gives --warmup's real default (a tenth of --steps: 2 of a
    20-step run), not the 30 of the default 300 steps."""
    with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
        config.parse_args(["--help"])
    text = " ".join(out.getvalue().split())
    assert "--warmup INT linear warmup steps (default: a tenth of --steps" in text
    assert "(default: 30)" not in text


def test_extending_a_decayed_schedule_is_refused(uninterrupted):
    _, save_dir = uninterrupted
    with pytest.raises(
        train_lm.UsageError,
        match=r"--steps 12: the cosine learning-rate schedule of this run depends "
        r"on its length \(8 steps\), and steps 3 to 7 already taken",
    ):
        train_lm.main(
            ["--resume", "--mesh", "none", "--save-dir", str(save_dir), "--steps", "12"]
        )


@pytest.mark.heavy
def test_switching_the_checkpoint_keeps_the_loss_curve(uninterrupted, tmp_path):
    """Resume a `"dots"` run under `recursive()`: only memory and FLOPs change."""
    result, _ = uninterrupted
    save_dir = str(tmp_path)
    first = train_lm.main([*TINY, "--save-dir", save_dir, "--stop-after", "4"])
    second = train_lm.main(["--resume", "--save-dir", save_dir, "--no-progress",
                            "--remat", "recursive()", "--mesh", "none"])  # fmt: skip
    assert second.state.model.checkpoint == eqx_remat.recursive()
    np.testing.assert_allclose(
        first.losses + second.losses, result.losses, rtol=1e-5, atol=0
    )
    for a, b in zip(arrays(second.state), arrays(result.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.heavy
def test_a_plain_resume_continues_with_the_saved_checkpoint(tmp_path, capsys):
    """Stopped under `every(2)` and resumed without `--remat`: the run goes on
    under `every(2)`, bit for bit as if uninterrupted. `--remat` given on
    resume changes it, with a line that says so."""
    every = [*TINY, "--remat", "every:2"]
    whole = train_lm.main([*every, "--save-dir", str(tmp_path / "whole")])
    save_dir = tmp_path / "run"
    train_lm.main([*every, "--save-dir", str(save_dir), "--stop-after", "4"])
    shutil.copytree(save_dir, tmp_path / "copy")
    capsys.readouterr()
    resume = ["--resume", "--no-progress", "--mesh", "none", "--save-dir"]
    resumed = train_lm.main([*resume, str(save_dir)])
    assert resumed.state.model.checkpoint == eqx_remat.every(2)
    assert "it was saved with" not in capsys.readouterr().err
    assert_same_state(resumed.state, whole.state)
    assert meta(save_dir, 8)["checkpoint"] == "every(2)"
    switched = train_lm.main([*resume, str(tmp_path / "copy"), "--remat", "dots"])
    assert switched.state.model.checkpoint == "dots"
    err = capsys.readouterr().err
    assert (
        "--remat dots: the run continues with dots (it was saved with every(2))" in err
    )


# --------------------------------------------------------------------------- damage


def damage(step_dir: Path, kind: str) -> None:
    """Damage the largest array file of a checkpoint (or its JSON item)."""
    if kind == "meta-flipped":
        target = step_dir / "meta" / "metadata"
    else:
        files = [p for p in (step_dir / "state").rglob("*") if p.parent.name == "d"]
        target = max(files, key=lambda p: p.stat().st_size)
    data = target.read_bytes()
    if kind == "truncated":
        data = data[: len(data) // 2]
    elif kind == "empty":
        data = b""
    elif kind == "random":
        data = random.Random(0).randbytes(len(data))
    else:  # four bytes flipped in the middle
        middle = bytearray(data)
        for i in range(len(data) // 2, len(data) // 2 + 4):
            middle[i] ^= 0xFF
        data = bytes(middle)
    target.write_bytes(data)


DAMAGE = ["truncated", "empty", "random", "flipped", "meta-flipped"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_newest_checkpoint_falls_back(
    uninterrupted, tmp_path, kind, capsys, caplog
):
    """One warning line, then the run's usual lines: none of Orbax's abandoned
    reads is reported (no traceback, no "Task exception was never retrieved";
    pytest would fail an unraisable exception too)."""
    result, reference = uninterrupted
    save_dir = tmp_path / "run"
    shutil.copytree(reference, save_dir)
    damage(save_dir / "8", kind)
    capsys.readouterr()
    resumed = train_lm.main(["--resume", "--save-dir", str(save_dir), "--no-progress",
                             "--eval-batches", "0", "--mesh", "none"])  # fmt: skip
    gc.collect()  # what is left of the failed restore reports now, if at all
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"warning: checkpoint {save_dir / '8'} is damaged (")
    assert err[0].endswith("); falling back to step 4")
    assert err[1].startswith("zoo.Transformer: ") and len(err) == 9, err
    assert err[6].startswith("step      8  loss ")
    assert err[7:] == [
        f"step 8 of 8: saved step 8 to {save_dir}",
        f"loss curve: {save_dir / 'loss.png'}",
    ], err
    assert not [r for r in caplog.records if r.name == "asyncio"]
    assert resumed.first_step == 4 and resumed.losses == result.losses[4:]
    assert_same_state(resumed.state, result.state)
    # The damaged one is set aside, and step 8 was saved again.
    assert (save_dir / "damaged-8").is_dir()
    assert meta(save_dir, 8)["sha256"] == meta(reference, 8)["sha256"]


ABANDONED_READS = """
import asyncio, gc, sys, threading, time
from orbax.checkpoint._src import asyncio_utils
from benchmarks.train.checkpointing import settled_reads

async def read(i):
    if i == 0:
        raise ValueError("damaged")
    # Still in flight when the first read fails: done later from another thread,
    # as TensorStore completes Orbax's reads (50 ms apart, so that their
    # tracebacks, where the loop is closed, do not interleave on stderr).
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    wake = lambda: loop.call_soon_threadsafe(done.set_result, None)
    threading.Timer(0.1 + 0.05 * i, wake).start()
    await done
    raise ValueError(f"damaged too ({i})")

async def restore():
    await asyncio.gather(*[read(i) for i in range(4)])

def attempt():
    try:
        asyncio_utils.run_sync(restore())  # as Orbax runs its restores
    except ValueError as e:
        print(f"warning: {e}", file=sys.stderr)

if sys.argv[1] == "settled":
    with settled_reads():
        attempt()
else:
    attempt()
time.sleep(0.5)
gc.collect()
"""


@pytest.mark.parametrize("settled", [True, False], ids=["settled", "plain"])
def test_abandoned_reads_are_settled(settled):
    """What a damaged checkpoint does to Orbax's restore, made certain: one read
    fails, the others are still in flight when Orbax closes its event loop. Within
    `settled_reads` the loop lets them finish first: stderr holds only the
    warning. Without, Python reports each abandoned read."""
    proc = subprocess.run(
        [sys.executable, "-c", ABANDONED_READS, "settled" if settled else "plain"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    if settled:
        assert proc.stderr == "warning: damaged\n"
    else:
        closed = proc.stderr.count("RuntimeError: Event loop is closed")
        assert closed == 3, proc.stderr  # one per read in flight


@pytest.mark.parametrize("kind", DAMAGE)
def test_no_intact_checkpoint_is_an_error(uninterrupted, tmp_path, kind):
    """Every checkpoint damaged: one line per checkpoint, then an `error:` line,
    rc 2 — never a traceback, never a silent load."""
    _, reference = uninterrupted
    shutil.copytree(reference, tmp_path / "run")
    for step in ("4", "8"):
        damage(tmp_path / "run" / step, kind)
    proc = script("--resume", "--save-dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 3, proc.stderr
    assert lines[0].startswith("warning: checkpoint") and "/8 is damaged (" in lines[0]
    assert lines[1].startswith("warning: checkpoint") and "/4 is damaged (" in lines[1]
    assert lines[2] == (
        f"train_lm.py: error: --resume: no intact checkpoint in {tmp_path / 'run'} "
        "(steps 8, 4 are all damaged)."
    )


# ---------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "0"], "argument --steps: expected a positive integer. Got '0'."),
        (["--log-every", "0"], "argument --log-every: expected a positive integer."),
        (["--save-every", "0"], "argument --save-every: expected a positive "),
        (["--stop-after", "-3"], "argument --stop-after: expected a positive "),
        (["--keep", "0"], "argument --keep: expected a positive integer. Got '0'."),
        (["--warmup", "-1"], "argument --warmup: expected an integer >= 0. Got"),
        (["--seed", "-1"], "argument --seed: expected an integer >= 0. Got '-1'."),
        (["--seed", "2147483648"], "argument --seed: expected at most 2147483647."),
        (["--data", "/nonexistent"], "argument --data: /nonexistent does not exist."),
        (["--lr", "-1"], "argument --lr: must be in (0, inf). Got -1.0."),
        (["--lr", "0"], "argument --lr: must be in (0, inf). Got 0.0."),
        (["--dropout", "2"], "argument --dropout: must be in [0, 1). Got 2.0."),
        (["--dropout", "1"], "argument --dropout: must be in [0, 1). Got 1.0."),
        (["--save-dir", "/proc/nope"], "argument --save-dir: /proc/nope is not a "),
        (["--remat", "every(two)"], "argument --remat: invalid checkpoint"),
        (["--remat", "every(0)"], "argument --remat: invalid checkpoint"),
        (["--remat", "dot"], "argument --remat: invalid checkpoint 'dot'"),
        (["--mesh", "tp:2"], "argument --mesh: expected auto, none, dp[:DEVICES]"),
        (["--resume"], "argument --resume: needs --save-dir."),
        (
            ["--eval-batches", "0", "--eval-every", "1"],
            "argument --eval-every: needs --eval-batches > 0: with 0 nothing is "
            "evaluated.",
        ),
        (["--heartbeat-timeout", "1"], "argument --heartbeat-timeout: needs "),
    ],
)
def test_bad_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_lm.main(flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: train_lm.py") and "Traceback" not in err
    assert message in err and "train_lm.py: error: argument --" in err


def test_flag_of_the_wrong_type_is_refused_by_tyro(capsys):
    """What tyro checks itself (choices, types) it reports in its own words."""
    for flags, message in [(["--device", "quantum"], "invalid choice 'quantum'"),
                           (["--steps", "two"], "--steps")]:  # fmt: skip
        with pytest.raises(SystemExit) as e:
            train_lm.main(flags)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--log-every", "0"], "error: argument --log-every: expected a positive "),
        (["--seed", "-1"], "error: argument --seed: expected an integer >= 0."),
        (["--d-model", "30", "--heads", "4"], "error: --d-model must be divisible"),
    ],
)
def test_bad_flag_script(flags, message, tmp_path):
    """From the command line: rc 2 and the message, before any training."""
    proc = script(*flags, "--save-dir", str(tmp_path))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "metrics.jsonl").exists()


def _refused(flags, tmp_path) -> str:
    """Run with `flags` and a --save-dir that does not exist: a `UsageError`
    (one `error:` line, rc 2, from the command line), and nothing written."""
    save_dir = tmp_path / "run"
    with pytest.raises(config.UsageError) as e:
        train_lm.main([*TINY, *flags, "--save-dir", str(save_dir)])
    assert not save_dir.exists(), sorted(save_dir.iterdir())
    return str(e.value)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "6", "--warmup", "30"], "--warmup must be in [0, steps). Got 30"),
        (["--mesh", f"fsdp:{jax.device_count() + 1}"], "expected 1 to"),
        (["--seq", "2000", "--data-bytes", "2000"], "too small for --seq 2000"),
        (
            ["--remat", "ranges(1:dots, 5:None)", "--layers", "4"],
            "add up to the depth of the stack, 4 layers. Got 1 + 5 = 6 layers",
        ),
    ],
    ids=["warmup", "mesh", "data", "ranges"],
)
def test_flags_checked_together_write_nothing(flags, message, tmp_path):
    """Errors that combine flags (or a flag and the machine) are found before
    anything is written: no metrics, no TensorBoard file, no --save-dir."""
    assert message in _refused(flags, tmp_path)


@pytest.mark.parametrize(
    "spec, layers",
    [
        ("every:4", 2),
        ("ranges(1:dots, 1:every:2)", 2),
        ("ranges(1:dots, 2:every:3)", 3),
    ],
)
def test_the_script_accepts_every_checkpoint_the_library_runs(spec, layers):
    """One rule, the library's: `every(K)` with `K` at least its range's layers
    re-runs them as one segment (`eqx_remat.every`'s docstring), and runs."""
    import zoo

    checkpoint = eqx_remat.parse_checkpoint(spec, depth=layers)
    config.check_remat(spec, checkpoint, layers)  # no UsageError
    net = zoo.ResidualChain(4, layers, checkpoint=checkpoint, key=jax.random.key(0))
    grad = eqx.filter_grad(lambda m: jax.numpy.sum(m(jax.numpy.ones(4))))
    got = eqx_remat.set_checkpoint(grad(net), None)
    want = grad(eqx_remat.set_checkpoint(net, None))
    for a, b in zip(arrays(got), arrays(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_defaults_that_depend_on_steps_scale_with_it():
    """`--steps 20` alone runs: the warmup is a tenth of the steps unless given
    (30 of the default 300), and a given one is kept."""

    def warmup(*flags):
        return config.run_config(config.parse_args(list(flags)), None, "cpu").warmup

    assert warmup() == 30 and warmup("--steps", "20") == 2
    assert warmup("--steps", "5") == 0 and warmup("--steps", "20", "--warmup", "7") == 7


def test_console_lines_fit_80_columns():
    """The log line at its widest (six-digit step, held-out loss, millions of
    tokens/s, MFU and peak memory) is two lines of at most 80 columns."""
    from benchmarks.train.metrics import log_line

    row = {"step": 999_999, "loss": 5.5452, "loss_avg": 5.5452, "eval_loss": 5.5452,
           "lr": 3e-3, "tokens_per_s": 9_999_999.0, "mfu": 0.512, "hfu": 0.634,
           "peak_bytes": 15.5 * 2**30}  # fmt: skip
    lines = log_line(row).splitlines()
    assert len(lines) == 2 and max(map(len, lines)) <= 80, lines
    cpu = {**row, "tokens_per_s": None, "mfu": None, "hfu": None, "peak_bytes": None}
    assert log_line(cpu).splitlines() == [
        "step 999999  loss 5.5452 (avg 5.5452)  eval 5.5452  lr 3.0e-03  compiled"
    ]


def test_remat_spec_uses_the_shared_parser():
    """`--remat` takes the spelling of every script, and the colon spelling that
    needs no shell quoting; both are read by `er.parse_checkpoint`."""
    from eqx_remat import parse_checkpoint

    for spec in ["None", "dots", "every(2)", "every(3, nothing)", "nested(2)",
                 "recursive()", "binomial(4)"]:  # fmt: skip
        assert config.remat_problem(spec) is None
        parse_checkpoint(spec)  # what the run uses
    pairs = [("every:4", "every(4)"), ("every:4:dots", "every(4, dots)"),
             ("recursive", "recursive()"), ("binomial:8", "binomial(8)"),
             ("nested:2:nothing", "nested(2, nothing)"),
             ("every:sqrt", "every(3)")]  # fmt: skip
    for colons, call in pairs:
        assert config.remat_problem(colons) is None
        assert parse_checkpoint(colons, depth=9) == parse_checkpoint(call, depth=9)


@pytest.mark.heavy
def test_resume_with_other_run_options_fails(uninterrupted):
    _, save_dir = uninterrupted
    args = ["--resume", "--mesh", "none", "--save-dir", str(save_dir), "--layers", "4"]
    with pytest.raises(train_lm.UsageError, match="--layers: checkpoint has 3, got 4"):
        train_lm.main(args)


def test_resume_without_a_checkpoint_fails(tmp_path):
    with pytest.raises(train_lm.UsageError, match="no checkpoint in"):
        train_lm.main(["--resume", "--save-dir", str(tmp_path)])


def test_a_new_run_never_overwrites_checkpoints(uninterrupted):
    _, save_dir = uninterrupted
    with pytest.raises(train_lm.UsageError, match="already holds checkpoints"):
        train_lm.main([*TINY, "--save-dir", str(save_dir)])


def test_step_flops_count_recomputation(uninterrupted):
    """MFU counts the step without recomputation, HFU with the run's checkpoint."""
    result, _ = uninterrupted
    c = config.RunConfig(**meta(uninterrupted[1], 8)["config"])
    tokens = jax.ShapeDtypeStruct((c.batch, c.seq + 1), np.int32)
    optimizer = train_model.make_optimizer(c)
    model, hardware = train_model.step_flops(result.state, tokens, optimizer)
    assert 0 < model < hardware
    none = eqx_remat.set_checkpoint(result.state, None)
    assert train_model.step_flops(none, tokens, optimizer) == (model, model)
    # The forward pass alone is at least 2 FLOPs per parameter and token.
    params = sum(x.size for x in arrays(result.state.model))
    assert model > 2 * params * c.batch * c.seq


def test_import_does_not_pick_the_platform():
    """Importing the script leaves JAX_PLATFORMS alone (`--device` decides)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = "import os, benchmarks.train_lm; print(os.environ.get('JAX_PLATFORMS'))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0 and proc.stdout == "None\n", proc.stderr


@pytest.mark.heavy
def test_fsdp_checkpoint_restores_into_its_shardings(uninterrupted, tmp_path):
    """Two host devices, FSDP: the state is saved sharded at step 4, read back
    shard by shard into the same shardings (its hash checked), and the resumed
    run follows the one-device loss curve (summed across devices: not bit for
    bit)."""
    result, _ = uninterrupted
    save_dir = str(tmp_path)
    code = f"""
import json
import equinox as eqx
from pathlib import Path
from benchmarks.train import checkpointing as ck, config, loop, model as m
args = {[*TINY, "--save-dir", save_dir, "--mesh", "fsdp:2"]!r}
first = loop.main([*args, "--stop-after", "4"])
mgr = ck.open_manager(Path({save_dir!r}), 3)
meta = ck.read_meta(mgr, 4)
c = config.RunConfig(**meta["config"])
placement = m.make_placement(("fsdp", 2), c.batch)
like = m.abstract_state(c, placement)
weight = ck.restore_state(mgr, 4, like, meta).model.blocks.mlp_in.weight
mgr.close()
second = loop.main(["--resume", *args[-4:], "--no-progress"])
print(json.dumps({{
    "losses": first.losses + second.losses,
    "spec": str(weight.sharding.spec),
    "shard": list(weight.addressable_shards[0].data.shape),
}}))
"""
    # Two CPU devices, beside the flags of the tests' environment (conftest.py).
    devices = "--xla_force_host_platform_device_count=2"
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {devices}"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "damaged" not in proc.stderr and "fsdp" in proc.stderr, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["spec"] == "P(None, None, 'data')"
    assert out["shard"] == [3, 32, 64]  # (layers, d_model, d_ff / 2)
    np.testing.assert_allclose(out["losses"], result.losses, rtol=1e-4, atol=0)


def test_only_process_zero_logs_and_writes_metrics(tmp_path, monkeypatch, capsys):
    """As another host of a multi-host run: silent, no metrics.jsonl or plot; the
    checkpoint is still written (Orbax writes each host's shards)."""
    monkeypatch.setattr(_device, "is_main_process", lambda: False)
    capsys.readouterr()
    result = train_lm.main([*TINY, "--save-dir", str(tmp_path), "--stop-after", "2"])
    assert result.stopped and len(result.losses) == 2
    assert capsys.readouterr().err == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]


# ----------------------------------------------------------------- data, run directory


def text(n: int, seed: int) -> bytes:
    """`n` bytes of lowercase words and newlines."""
    rng = random.Random(seed)
    words = ["def", "return", "self", "value", "import", "class", "lambda", "for"]
    out = b""
    while len(out) < n:
        out += " ".join(rng.choice(words) for _ in range(8)).encode() + b"\n"
    return out[:n]


def test_load_corpus_reads_a_file_or_a_directory(tmp_path):
    """A file as it is; a directory as its text files joined in sorted path
    order, subdirectories included, hidden and binary ones skipped."""
    from benchmarks.train import data

    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    files = {"a.txt": text(300, 1), "b/c.md": text(200, 2), "d": text(100, 3)}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    (tmp_path / ".hidden").write_bytes(b"not read")
    (tmp_path / ".git" / "config").write_bytes(b"not read")
    (tmp_path / "b" / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    joined = files["a.txt"] + files["b/c.md"] + files["d"]
    corpus, digest = data.load_corpus(str(tmp_path))
    assert corpus.dtype == np.uint8 and corpus.tobytes() == joined
    assert digest == hashlib.sha256(joined).hexdigest()
    corpus, _ = data.load_corpus(str(tmp_path / "a.txt"), 120)
    assert corpus.tobytes() == files["a.txt"][:120]


def test_data_trains_on_a_file_into_the_default_run_directory(
    uninterrupted, tmp_path, monkeypatch, capsys
):
    """`--data FILE` without `--save-dir`: the run's metrics, TensorBoard events
    and plot go to a fresh benchmarks/runs/train_lm-<date>/ (here under
    tmp_path), with no checkpoint; the console shows the logged loss."""
    from benchmarks.train import files

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(text(20_000, 0))
    monkeypatch.setattr(files, "RUNS", tmp_path / "runs")
    capsys.readouterr()
    result = train_lm.main([*TINY, "--data", str(corpus), "--stop-after", "4"])
    assert result.stopped and len(result.losses) == 4
    assert all(np.isfinite(result.losses))
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("train_lm-")
    names = sorted(p.name for p in run_dir.iterdir())
    assert names[0].startswith("events.out.tfevents.")
    assert names[1:] == ["loss.png", "metrics.jsonl"]  # no checkpoint
    (row,) = metrics(run_dir)
    assert row["step"] == 4 and row["loss"] == result.losses[3]
    assert scalars(run_dir)["loss/train"] == [(4, pytest.approx(row["loss"], rel=1e-6))]
    err = capsys.readouterr().err
    assert f"--data {corpus}: 19,000 + 1,000 held-out bytes" in err
    assert f"metrics in {run_dir}" in err
    assert f"step      4  loss {row['loss']:.4f} (avg {row['loss_avg']:.4f}" in err
    # The header says where it runs in words, the end where the plot went.
    header = err.splitlines()[:5]
    assert header[0].startswith("zoo.Transformer: ") and "x1" not in err
    assert "  on 1 cpu device, no sharding" in err
    assert all(len(line) <= 80 for line in header[:3]), header  # no path there
    assert err.splitlines()[-1] == f"loss curve: {run_dir / 'loss.png'}"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.write_bytes(b""), "argument --data: {p} is empty."),
        (lambda p: p.mkdir(), "argument --data: {p} holds no text file with any "),
    ],
    ids=["empty file", "empty directory"],
)
def test_data_that_cannot_be_read_is_a_usage_error(make, message, tmp_path, capsys):
    path = tmp_path / "text"
    make(path)
    with pytest.raises(SystemExit) as e:
        train_lm.main(["--data", str(path)])
    assert e.value.code == 2
    assert message.format(p=path) in capsys.readouterr().err


def test_data_shorter_than_a_sequence_is_a_usage_error(tmp_path):
    corpus = tmp_path / "short.txt"
    corpus.write_bytes(text(600, 0))
    with pytest.raises(
        train_lm.UsageError,
        match=r"The corpus \(--data .*short.txt: 600 bytes, 30 held out\) is too "
        r"small for --seq 32: each part needs more than 32 bytes",
    ):
        train_lm.main([*TINY, "--data", str(corpus), "--save-dir", str(tmp_path)])
    assert not (tmp_path / "metrics.jsonl").exists()
