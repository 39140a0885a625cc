"""benchmarks/train_lm.py: it learns; it survives SIGTERM, damaged checkpoints and
bad flags; it resumes bit for bit; the checkpoint schedule changes nothing but
memory and FLOPs.

Compiles are slow on two cores, so one compiled step serves most tests: runs of
the same `RunConfig` in this process share it (the script caches its optimiser).
What must be seen from outside (return codes, one-line errors, signals) runs the
script in a subprocess, before any compile where it can."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

import benchmarks.train_lm as train_lm
import eqx_remat


SCRIPT = Path(train_lm.__file__)
TINY = [
    "--seed", "0", "--steps", "8", "--batch", "4", "--seq", "32", "--d-model",
    "32", "--heads", "2", "--layers", "3", "--lr", "3e-3", "--warmup", "2",
    "--data-bytes", "200000", "--log-every", "4", "--save-every", "4",
    "--eval-batches", "0", "--no-progress",
]  # fmt: skip


def arrays(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def assert_same_state(a, b):
    for x, y in zip(arrays(a), arrays(b), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def metrics(ckpt_dir: Path) -> list[dict]:
    lines = (ckpt_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def script(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def meta(ckpt_dir: Path, step: int) -> dict:
    return json.loads((ckpt_dir / str(step) / "meta" / "metadata").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Eight steps in one go, under `"dots"`, saved at steps 4 and 8."""
    ckpt_dir = tmp_path_factory.mktemp("uninterrupted")
    result = train_lm.main([*TINY, "--checkpoint", "dots", "--ckpt-dir", str(ckpt_dir)])
    return result, ckpt_dir


def test_loss_decreases(uninterrupted):
    result, _ = uninterrupted
    losses = result.losses
    assert len(losses) == 8 and result.first_step == 0 and not result.stopped
    assert all(np.isfinite(losses))
    # Byte-level: the loss starts near ln(256) = 5.55 and learns the byte
    # frequencies within a few steps.
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.3, losses


def test_checkpoints_and_metrics(uninterrupted):
    result, ckpt_dir = uninterrupted
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [
        "4", "8", "loss.png", "metrics.jsonl",
    ]  # fmt: skip
    assert (ckpt_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = metrics(ckpt_dir)
    assert [r["step"] for r in rows] == [4, 8]
    assert [r["loss"] for r in rows] == [result.losses[3], result.losses[7]]
    assert rows[1]["loss_avg"] == pytest.approx(np.mean(result.losses[4:]), rel=1e-6)
    for r in rows:
        assert r["eval_loss"] is None and r["lr"] > 0 and r["wall_s"] > 0
        # The first line times steps 2-4 only: step 1 compiled.
        assert r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_s"], rel=1e-9)
        # The CPU reports neither peak memory nor a peak FLOP/s.
        assert r["peak_bytes"] is None and r["mfu"] is None and r["hfu"] is None
    m = meta(ckpt_dir, 8)
    assert m["step"] == 8 and m["config"]["steps"] == 8 and len(m["sha256"]) == 1
    assert m["sha256"][0] == train_lm.content_sha256(
        eqx.filter(result.state, eqx.is_array)
    )


def test_sigterm_then_resume_is_bit_identical(uninterrupted, tmp_path):
    """SIGTERM during the first step's compile: the step finishes, is saved, one
    line says so, rc 0. `--resume` then ends where the uninterrupted run ended:
    the same losses in metrics.jsonl, the same parameters and optimiser state."""
    result, reference = uninterrupted
    with subprocess.Popen(
        [sys.executable, str(SCRIPT), *TINY, "--ckpt-dir", str(tmp_path)],
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        header = proc.stderr.readline()
        assert header.startswith("zoo.Transformer:"), header
        proc.send_signal(signal.SIGTERM)  # handled once the compile returns
        rest = proc.stderr.read()
        assert proc.wait(timeout=300) == 0, rest
    assert rest.splitlines() == [
        f"SIGTERM: stopped after step 1 of 8; saved step 1 to {tmp_path}; continue "
        f"with --resume --ckpt-dir {tmp_path}"
    ]
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [1]

    resumed = train_lm.main(["--resume", "--ckpt-dir", str(tmp_path), "--no-progress",
                             "--log-every", "4", "--eval-batches", "0"])  # fmt: skip
    assert resumed.first_step == 1 and resumed.losses == result.losses[1:]
    assert metrics(tmp_path)[-1]["loss"] == metrics(reference)[-1]["loss"]
    assert [r["step"] for r in metrics(tmp_path)] == [4, 8]
    assert_same_state(resumed.state, result.state)
    assert meta(tmp_path, 8)["sha256"] == meta(reference, 8)["sha256"]


def test_stop_after_then_extend_is_bit_identical(uninterrupted, tmp_path):
    """A 6-step run stopped in its warmup is extended to 8 steps: the learning
    rates so far are those of an 8-step run, so it ends as the 8-step run does."""
    result, _ = uninterrupted
    args = [*TINY, "--ckpt-dir", str(tmp_path)]
    first = train_lm.main([*args, "--steps", "6", "--stop-after", "2"])
    assert first.stopped and first.losses == result.losses[:2]
    second = train_lm.main(["--resume", "--steps", "8", *args[-2:], "--no-progress"])
    assert second.first_step == 2 and second.losses == result.losses[2:]
    assert_same_state(second.state, result.state)


def test_extending_a_decayed_schedule_is_refused(uninterrupted):
    _, ckpt_dir = uninterrupted
    with pytest.raises(
        train_lm.UsageError,
        match=r"--steps 12: the cosine learning-rate schedule of this run depends "
        r"on its length \(8 steps\), and steps 3 to 7 already taken",
    ):
        train_lm.main(["--resume", "--ckpt-dir", str(ckpt_dir), "--steps", "12"])


def test_switching_the_checkpoint_keeps_the_loss_curve(uninterrupted, tmp_path):
    """Resume a `"dots"` run under `recursive()`: only memory and FLOPs change."""
    result, _ = uninterrupted
    ckpt_dir = str(tmp_path)
    first = train_lm.main([*TINY, "--ckpt-dir", ckpt_dir, "--stop-after", "4"])
    second = train_lm.main(["--resume", "--ckpt-dir", ckpt_dir, "--no-progress",
                            "--checkpoint", "recursive()"])  # fmt: skip
    assert second.state.model.checkpoint == eqx_remat.recursive()
    np.testing.assert_allclose(
        first.losses + second.losses, result.losses, rtol=1e-5, atol=0
    )
    for a, b in zip(arrays(second.state), arrays(result.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


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
def test_damaged_newest_checkpoint_falls_back(uninterrupted, tmp_path, kind, capsys):
    result, reference = uninterrupted
    ckpt_dir = tmp_path / "run"
    shutil.copytree(reference, ckpt_dir)
    damage(ckpt_dir / "8", kind)
    capsys.readouterr()
    resumed = train_lm.main(["--resume", "--ckpt-dir", str(ckpt_dir), "--no-progress"])
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"warning: checkpoint {ckpt_dir / '8'} is damaged (")
    assert err[0].endswith("); falling back to step 4")
    assert resumed.first_step == 4 and resumed.losses == result.losses[4:]
    assert_same_state(resumed.state, result.state)
    # The damaged one is set aside, and step 8 was saved again.
    assert (ckpt_dir / "damaged-8").is_dir()
    assert meta(ckpt_dir, 8)["sha256"] == meta(reference, 8)["sha256"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_no_intact_checkpoint_is_an_error(uninterrupted, tmp_path, kind):
    """Every checkpoint damaged: one line per checkpoint, then an `error:` line,
    rc 2 — never a traceback, never a silent load."""
    _, reference = uninterrupted
    shutil.copytree(reference, tmp_path / "run")
    for step in ("4", "8"):
        damage(tmp_path / "run" / step, kind)
    proc = script("--resume", "--ckpt-dir", str(tmp_path / "run"))
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
        (["--steps", "0"], "argument --steps: must be >= 1. Got 0."),
        (["--log-every", "0"], "argument --log-every: must be >= 1. Got 0."),
        (["--save-every", "0"], "argument --save-every: must be >= 1. Got 0."),
        (["--stop-after", "-3"], "argument --stop-after: must be >= 1. Got -3."),
        (["--keep", "0"], "argument --keep: must be >= 1. Got 0."),
        (["--lr", "-1"], "argument --lr: must be in (0, inf). Got -1.0."),
        (["--lr", "0"], "argument --lr: must be in (0, inf). Got 0.0."),
        (["--dropout", "2"], "argument --dropout: must be in [0, 1). Got 2.0."),
        (["--dropout", "1"], "argument --dropout: must be in [0, 1). Got 1.0."),
        (["--ckpt-dir", "/proc/nope"], "argument --ckpt-dir: /proc/nope is not a "),
        (
            ["--checkpoint", "every:4"],
            "argument --checkpoint: 'every:4' is the old spelling; write every(4) ",
        ),
        (["--checkpoint", "every:2:dots"], "spelling; write every(2, dots) ("),
        (["--checkpoint", "recursive"], "spelling; write recursive() ("),
        (["--checkpoint", "every(two)"], "argument --checkpoint: invalid checkpoint"),
        (["--checkpoint", "every(0)"], "argument --checkpoint: invalid checkpoint"),
        (["--checkpoint", "dot"], "argument --checkpoint: invalid checkpoint 'dot'"),
        (["--mesh", "tp:2"], "argument --mesh: expected auto, none, dp[:DEVICES]"),
        (["--resume"], "argument --resume: needs --ckpt-dir."),
        (["--device", "quantum"], "argument --device: invalid choice: 'quantum'"),
    ],
)
def test_bad_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_lm.main(flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: train_lm.py") and "Traceback" not in err
    assert message in err and "train_lm.py: error: argument --" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--log-every", "0"], "error: argument --log-every: must be >= 1. Got 0."),
        (["--d-model", "30", "--heads", "4"], "error: --d-model must be divisible"),
    ],
)
def test_bad_flag_script(flags, message, tmp_path):
    """From the command line: rc 2 and the message, before any training."""
    proc = script(*flags, "--ckpt-dir", str(tmp_path))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "metrics.jsonl").exists()


def test_checkpoint_spec_uses_the_shared_parser():
    from benchmarks._common import parse_checkpoint

    for spec in ["None", "dots", "every(2)", "every(3, nothing)", "nested(2)",
                 "recursive()", "binomial(4)"]:  # fmt: skip
        assert train_lm.checkpoint_spec(spec) == spec
        parse_checkpoint(spec)  # what the run uses
    assert not hasattr(train_lm, "parse_checkpoint_spec")


def test_resume_with_other_run_options_fails(uninterrupted):
    _, ckpt_dir = uninterrupted
    args = ["--resume", "--ckpt-dir", str(ckpt_dir), "--layers", "4"]
    with pytest.raises(train_lm.UsageError, match="--layers: checkpoint has 3, got 4"):
        train_lm.main(args)


def test_resume_without_a_checkpoint_fails(tmp_path):
    with pytest.raises(train_lm.UsageError, match="no checkpoint in"):
        train_lm.main(["--resume", "--ckpt-dir", str(tmp_path)])


def test_a_new_run_never_overwrites_checkpoints(uninterrupted):
    _, ckpt_dir = uninterrupted
    with pytest.raises(train_lm.UsageError, match="already holds checkpoints"):
        train_lm.main([*TINY, "--ckpt-dir", str(ckpt_dir)])


def test_step_flops_count_recomputation(uninterrupted):
    """MFU counts the step without recomputation, HFU with the run's checkpoint."""
    result, _ = uninterrupted
    c = train_lm.RunConfig(**meta(uninterrupted[1], 8)["config"])
    tokens = jax.ShapeDtypeStruct((c.batch, c.seq + 1), np.int32)
    optimizer = train_lm.make_optimizer(c)
    model, hardware = train_lm.step_flops(result.state, tokens, optimizer)
    assert 0 < model < hardware
    none = eqx_remat.set_checkpoint(result.state, None)
    assert train_lm.step_flops(none, tokens, optimizer) == (model, model)
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


def test_fsdp_checkpoint_restores_into_its_shardings(uninterrupted, tmp_path):
    """Two host devices, FSDP: the state is saved sharded at step 4, read back
    shard by shard into the same shardings (its hash checked), and the resumed
    run follows the one-device loss curve (summed across devices: not bit for
    bit)."""
    result, _ = uninterrupted
    ckpt_dir = str(tmp_path)
    code = f"""
import json
import equinox as eqx
import benchmarks.train_lm as t
args = {[*TINY, "--ckpt-dir", ckpt_dir, "--mesh", "fsdp:2"]!r}
first = t.main([*args, "--stop-after", "4"])
mgr = t.open_manager(t.Path({ckpt_dir!r}), 3)
meta = t.read_meta(mgr, 4)
c = t.RunConfig(**meta["config"])
placement = t.make_placement(("fsdp", 2), c.batch)
like = placement.params(eqx.filter_eval_shape(t.init_state, c))
weight = t.restore_state(mgr, 4, like, meta).model.blocks.mlp_in.weight
mgr.close()
second = t.main(["--resume", *args[-4:], "--no-progress"])
print(json.dumps({{
    "losses": first.losses + second.losses,
    "spec": str(weight.sharding.spec),
    "shard": list(weight.addressable_shards[0].data.shape),
}}))
"""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
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
    monkeypatch.setattr(train_lm._device, "is_main_process", lambda: False)
    capsys.readouterr()
    result = train_lm.main([*TINY, "--ckpt-dir", str(tmp_path), "--stop-after", "2"])
    assert result.stopped and len(result.losses) == 2
    assert capsys.readouterr().err == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]
