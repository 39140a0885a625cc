"""The multi-host path, run for real on this machine: two processes on 127.0.0.1,
two CPU devices each, gloo collectives, JAX's multi-controller runtime
(`jax.distributed.initialize`) as on every host of a TPU slice.

Each test starts its processes with tests/multihost_helpers.py: a free port, the
coordinator bound to loopback, a deadline, and every process killed at the end.
The tests that start processes are `slow` (CI runs them with `pytest -m slow`);
the checks of the command line are quick."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import multihost_helpers as mh
import numpy as np
import pytest

from benchmarks import _device


ROOT = Path(__file__).resolve().parents[1]


CHECK = Path(__file__).with_name("_multihost_check.py")
# f32, the batch split 4 ways and FSDP contractions summed in another order than
# one device sums them (as tests/test_sharding.py, seen ~1e-6).
RTOL, ATOL = 1e-5, 1e-6


# ------------------------------------------------------------------ the library


def _check(name: str, out: Path, timeout: float) -> None:
    done = mh.run(lambda i: [str(CHECK), name, str(out)], timeout=timeout)
    mh.assert_ok(done)
    for f in done:
        assert f.stdout.splitlines()[-1] == "ok", f.tail()


@pytest.mark.slow
def test_gradients_across_processes_equal_one_process(tmp_path):
    """Every zoo model (MLP, ResidualChain, Transformer, Llama) under `"dots"`,
    `recursive()`, `ranges(...)` and `"offload_dots_no_batch"`, FSDP-sharded over
    the 4 devices of 2 processes with the batch split between them: the loss and
    the gradients equal those of `checkpoint=None` in this one process, on one
    device, and both processes hold the same values."""
    sys.path.insert(0, str(CHECK.parent))
    import _multihost_check as check

    _check("grads", tmp_path, timeout=500)
    got = [np.load(tmp_path / f"grads-{i}.npz") for i in range(2)]
    assert sorted(got[0].files) == sorted(got[1].files)
    for key in got[0].files:
        np.testing.assert_array_equal(got[0][key], got[1][key], err_msg=key)
    compared = 0
    for name, (model, kind) in check.models().items():
        x = check.batch_of(kind)
        fn = eqx.filter_jit(eqx.filter_value_and_grad(check.loss))
        value, grads = fn(model, x)  # checkpoint=None: the zoo's default
        expected = [np.asarray(g) for g in jax.tree.leaves(grads)]
        for label in check.checkpoints():
            key = f"{name}/{label}"
            np.testing.assert_allclose(
                got[0][f"{key}/loss"], value, rtol=RTOL, atol=ATOL, err_msg=key
            )
            leaves = sorted(
                (int(k.rsplit("/", 1)[1]), k)
                for k in got[0].files
                if k.startswith(key + "/") and not k.endswith("/loss")
            )
            assert len(leaves) == len(expected), key
            for (_, k), e in zip(leaves, expected, strict=True):
                a = got[0][k]
                np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL, err_msg=k)
                compared += 1
    assert compared > 50, compared


@pytest.mark.slow
def test_memory_report_and_plan_agree_across_processes(tmp_path):
    """`memory_report` and `plan` of an FSDP gradient over 2 processes: process 0
    alone gets its answer while the other waits (nothing in them waits for the
    other processes), and every process then gets that same answer."""
    _check("inspect", tmp_path, timeout=500)
    got = [json.loads((tmp_path / f"inspect-{i}.json").read_text()) for i in range(2)]
    alone = got[0]["alone"]
    assert got[1]["alone"] is None
    assert alone["report"]["temp_bytes"] > 0 and alone["report"]["flops"] > 0
    assert alone["fits"] and alone["memory_bytes"] <= alone["budget"]
    assert len(alone["frontier"]) >= 2
    assert got[0]["together"] == alone
    assert got[1]["together"] == alone


# --------------------------------------------------------------- train_lm.py

TRAIN = ["benchmarks/train_lm.py"]
TINY = [
    "--seed", "0", "--steps", "8", "--batch", "4", "--seq", "32", "--d-model",
    "32", "--heads", "2", "--layers", "3", "--lr", "3e-3", "--warmup", "2",
    "--data-bytes", "200000", "--log-every", "4", "--save-every", "4",
    "--eval-batches", "0", "--no-progress", "--remat", "dots",
]  # fmt: skip
DISTRIBUTED = ["--distributed", "--mesh", "fsdp"]


def _train(*args: str, timeout: float = 300, heartbeat: int = 60) -> mh.Group:
    flags = [*DISTRIBUTED, "--heartbeat-timeout", str(heartbeat)]
    return mh.Group(lambda i: [*TRAIN, *args, *flags], timeout=timeout)


def _metrics(save_dir: Path) -> list[dict]:
    lines = (save_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def _meta(save_dir: Path, step: int) -> dict:
    return json.loads((save_dir / str(step) / "meta" / "metadata").read_text())


def _spoken(stderr: str) -> list[str]:
    """The lines train_lm.py writes (not JAX's, absl's or gloo's logs)."""
    noise = ("W0000", "I0000", "W1", "I1", "E1", "[Gloo]", "WARNING:absl")
    return [x for x in stderr.splitlines() if x and not x.startswith(noise)]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """Eight steps on 2 processes (FSDP over 4 devices), uninterrupted."""
    save_dir = tmp_path_factory.mktemp("two-processes")
    done = _train(*TINY, "--save-dir", str(save_dir)).finish()
    mh.assert_ok(done)
    return save_dir, done


@pytest.mark.slow
def test_two_processes_train_like_one(two_process_run, tmp_path):
    """Only process 0 speaks and writes metrics; the checkpoints hold both
    processes' content hashes; the losses equal one process's on one device."""
    save_dir, done = two_process_run
    lines = _spoken(done[0].stderr)
    assert lines[0].startswith("zoo.Transformer:"), lines
    assert "  on 4 cpu devices, FSDP" in lines[:4], lines
    assert lines[-2:] == [
        f"step 8 of 8: saved step 8 to {save_dir}",
        f"loss curve: {save_dir / 'loss.png'}",
    ], lines
    assert _spoken(done[1].stderr) == [] and "step" not in done[1].stdout
    rows = _metrics(save_dir)
    assert [r["step"] for r in rows] == [4, 8]
    assert sorted(p.name for p in save_dir.iterdir() if p.name.isdigit()) == ["4", "8"]
    hashes = _meta(save_dir, 8)["sha256"]
    assert len(hashes) == 2 and hashes[0] != hashes[1]  # each its own shards

    from benchmarks import train as train_lm

    one = train_lm.main([*TINY, "--mesh", "none", "--save-dir", str(tmp_path)])
    np.testing.assert_allclose(
        [r["loss"] for r in rows], [one.losses[3], one.losses[7]], rtol=RTOL, atol=0
    )


@pytest.mark.slow
def test_sigterm_to_one_process_then_resume_is_bit_identical(two_process_run, tmp_path):
    """SIGTERM to process 1 alone: both processes stop after the same step, save
    it together and exit 0 (process 0 says so). `--resume` on 2 processes ends
    where the uninterrupted run ended: the same losses, the same bytes in every
    process's shards of the step-8 checkpoint."""
    reference, _ = two_process_run
    run = _train(*TINY, "--save-dir", str(tmp_path))
    run.wait_for(0, "zoo.Transformer:")
    run.signal(1, signal.SIGTERM)
    done = run.finish()
    mh.assert_ok(done)
    saved = sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit())
    assert len(saved) == 1 and 1 <= saved[0] < 8, saved
    stop = saved[0]
    assert _spoken(done[0].stderr)[-2:] == [
        f"preemption: stopped after step {stop} of 8; saved step {stop} to "
        f"{tmp_path}; continue with --resume --save-dir {tmp_path}",
        f"loss curve: {tmp_path / 'loss.png'}",
    ]
    assert _meta(tmp_path, stop)["step"] == stop

    resume = ["--resume", "--save-dir", str(tmp_path), "--no-progress"]
    done = _train(*resume, "--log-every", "4", "--eval-batches", "0").finish()
    mh.assert_ok(done)
    assert _spoken(done[0].stderr)[-2:] == [
        f"step 8 of 8: saved step 8 to {tmp_path}",
        f"loss curve: {tmp_path / 'loss.png'}",
    ]
    assert _metrics(tmp_path)[-1]["loss"] == _metrics(reference)[-1]["loss"]
    assert _meta(tmp_path, 8)["sha256"] == _meta(reference, 8)["sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_dying_process_ends_the_run(victim, tmp_path):
    """SIGKILL to one process mid-run: the other ends with a reason, never a
    hang. Either its next collective fails and it says so (rc 1, our line that
    another process stopped), or JAX's coordination service takes the dead
    process as gone within `--heartbeat-timeout` and aborts it (SIGABRT, JAX's
    line that another task died). Which one is a race: a gloo all-reduce
    already waiting for the dead process's data is not told that it died (seen
    with process 1 killed: process 0 waits in gloo's `UnboundBuffer::waitRecv`),
    and the coordination service dies with process 0."""
    heartbeat = 15
    long = [*TINY, "--steps", "100000", "--log-every", "1", "--save-every", "1000"]
    run = _train(*long, "--save-dir", str(tmp_path), timeout=300, heartbeat=heartbeat)
    run.wait_for(0, "step      3")
    run.signal(victim, signal.SIGKILL)
    killed = time.monotonic() - run.start
    done = run.finish()
    survivor = done[1 - victim]
    assert done[victim].returncode == -signal.SIGKILL
    assert survivor.returncode in (1, -signal.SIGABRT), survivor.tail()
    assert survivor.seconds - killed < heartbeat + 10, (survivor.seconds, killed)
    if survivor.returncode == 1:
        mine = f"train_lm.py: error: process {1 - victim} of 2: "
        assert mine in survivor.stderr, survivor.tail()
        if victim == 1:  # the coordination service lives on: a collective failed
            assert f"{mine}a computation shared with the other processes failed" in (
                survivor.stderr
            )
            assert "another process of the run has stopped or died" in survivor.stderr
    else:
        jax_says = "This most likely indicates that another task died"
        assert jax_says in survivor.stderr, survivor.tail()


@pytest.mark.slow
def test_a_mesh_without_every_process_is_refused(tmp_path):
    """`--mesh dp:2` on 2 processes of 2 devices would leave process 1 out: every
    process stops with the same `error:` line, status 2, before any step. (The
    processes find each other from the flags alone, not the environment.)"""
    argv = [*TRAIN, *TINY, *DISTRIBUTED, "--mesh", "dp:2", "--save-dir", str(tmp_path)]

    def with_flags(i: int, port: int) -> list[str]:
        address = ["--coordinator-address", f"127.0.0.1:{port}"]
        return [*argv, *address, "--num-processes", "2", "--process-id", str(i)]

    done = mh.run(with_flags, timeout=120, flags=True)
    for f in done:
        assert f.returncode == 2, f.tail()
        assert (
            "train_lm.py: error: --mesh dp:2: with 2 processes the mesh must span "
            "all 4 devices. Use --mesh auto, dp or fsdp."
        ) in f.stderr


# --------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-processes", "2"], "argument --num-processes: needs --distributed."),
        (["--process-id", "0"], "argument --process-id: needs --distributed."),
        (
            ["--coordinator-address", "127.0.0.1"],
            "argument --coordinator-address: expected HOST:PORT with a port in "
            "1..65535. Got '127.0.0.1'.",
        ),
        (
            ["--distributed", "--num-processes", "2", "--process-id", "2"],
            "argument --process-id: expected 0 to 1 (argument --num-processes is "
            "2). Got 2.",
        ),
        (["--num-processes", "0"], "argument --num-processes: expected a positive "),
        (["--process-id", "-1"], "argument --process-id: expected an integer >= 0."),
    ],
)
def test_bad_distributed_flag(flags, message, capsys):
    from benchmarks import train as train_lm

    with pytest.raises(SystemExit) as e:
        train_lm.main(flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: train_lm.py") and "Traceback" not in err
    assert message in err


def _settings(argv: list[str], monkeypatch, **env: str) -> dict:
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    import argparse

    parser = argparse.ArgumentParser(prog="x")
    _device.add_device_args(parser)
    return _device.distributed_settings(parser.parse_args(argv), parser)


def test_distributed_settings_from_flags_and_environment(monkeypatch):
    """Flags first, then JAX's variable for the address and ours for the count
    and id; a loopback coordinator binds to loopback only; nothing given leaves
    everything to JAX's auto-detection (a TPU slice)."""
    assert _settings(["--distributed"], monkeypatch) == {
        "heartbeat_timeout_seconds": 100
    }
    env = {
        "JAX_COORDINATOR_ADDRESS": "127.0.0.1:4321",
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": "1",
    }
    assert _settings(["--distributed"], monkeypatch, **env) == {
        "coordinator_address": "127.0.0.1:4321",
        "coordinator_bind_address": "127.0.0.1:4321",
        "num_processes": 2,
        "process_id": 1,
        "heartbeat_timeout_seconds": 100,
    }
    flags = ["--distributed", "--coordinator-address", "10.0.0.2:99", "--process-id"]
    flags += ["0", "--heartbeat-timeout", "7"]
    assert _settings(flags, monkeypatch, **env) == {
        "coordinator_address": "10.0.0.2:99",
        "num_processes": 2,
        "process_id": 0,
        "heartbeat_timeout_seconds": 7,
    }


def test_bad_environment_variable_names_it(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _settings(["--distributed"], monkeypatch, JAX_NUM_PROCESSES="two")
    err = capsys.readouterr().err
    assert "error: environment variable JAX_NUM_PROCESSES: expected a positive " in err
    assert "integer. Got 'two'." in err
    with pytest.raises(SystemExit):
        env = {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "5"}
        _settings(["--distributed"], monkeypatch, **env)
    assert (
        "error: environment variable JAX_PROCESS_ID: expected 0 to 1 (environment "
        "variable JAX_NUM_PROCESSES is 2). Got 5."
    ) in capsys.readouterr().err


def test_distributed_with_nothing_to_find_the_processes_is_an_error(tmp_path):
    """On a machine where JAX detects no cluster, `--distributed` alone stops
    with one `error:` line that says which flags to give, status 2. In a
    process of its own: `jax.distributed.initialize` must come before JAX
    starts its backend, which other tests of this process may have done."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    }
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "train_lm.py"),
            "--distributed",
            "--device",
            "cpu",
            "--num-processes",
            "2",
            "--save-dir",
            str(tmp_path / "s"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert "train_lm.py: error: --distributed: coordinator_address should be " in err
    assert "give --coordinator-address, --process-id (or $JAX_COORDINATOR_" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------- run.py


@pytest.mark.slow
def test_run_distributed_writes_one_results_file(tmp_path):
    """`benchmarks/run.py --distributed` on 2 processes: the sweep's per-device
    compiled memory and step times of the program both ran, in one results file
    written by process 0; process 1 prints no table."""
    argv = ["benchmarks/run.py", "--distributed", "--preset", "transformer-tiny"]
    argv += ["--no-peers", "--quick", "--out", str(tmp_path)]
    done = mh.run(lambda i: argv, timeout=400)
    mh.assert_ok(done)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "sweep-cpu-quick.csv",
        "sweep-cpu-quick.json",
        "sweep-cpu-quick.png",
    ]
    printed = " ".join(done[0].stdout.split())  # rich wraps the long path
    assert "results in" in printed and "sweep-cpu-quick.json" in printed
    assert "results in" not in done[1].stdout and "impl" not in done[1].stdout
    data = json.loads((tmp_path / "sweep-cpu-quick.json").read_text())
    assert data["meta"]["process_count"] == 2 and data["meta"]["device_count"] == 4
    rows = data["rows"]
    assert {r["checkpoint"] for r in rows} == {"None", "dots"}
    for r in rows:
        assert r["process_index"] == 0 and r["device_count"] == 4
        assert r["temp_bytes"] > 0 and r["step_s"] > 0
