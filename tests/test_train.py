"""benchmarks/train_lm.py: it learns, it resumes bit for bit, and the checkpoint
schedule changes nothing but memory and FLOPs."""

import importlib.util
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_remat


_SCRIPT = Path(__file__).parents[1] / "benchmarks" / "train_lm.py"
_spec = importlib.util.spec_from_file_location("train_lm", _SCRIPT)
train_lm = importlib.util.module_from_spec(_spec)
sys.modules["train_lm"] = train_lm  # dataclasses look their module up here
_spec.loader.exec_module(train_lm)

# A few seconds per compile on two cores. Equal configs share the compiled step
# (the script caches its optimiser), so only a new `--checkpoint` recompiles.
TINY = [
    "--seed", "0", "--steps", "8", "--batch", "4", "--seq", "32", "--d-model",
    "32", "--heads", "2", "--layers", "3", "--lr", "3e-3", "--warmup", "2",
    "--data-bytes", "200000", "--log-every", "4", "--eval-batches", "0",
    "--no-progress",
]  # fmt: skip


def arrays(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Eight steps in one go, under `"dots"`."""
    ckpt_dir = tmp_path_factory.mktemp("uninterrupted")
    result = train_lm.main([*TINY, "--checkpoint", "dots", "--ckpt-dir", str(ckpt_dir)])
    return result, ckpt_dir / train_lm.CHECKPOINT_FILE


def test_loss_decreases(uninterrupted):
    result, _ = uninterrupted
    losses = result.losses
    assert len(losses) == 8 and result.first_step == 0
    assert all(np.isfinite(losses))
    # Byte-level: the loss starts near ln(256) = 5.55 and learns the byte
    # frequencies within a few steps.
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.3, losses


def test_resume_is_bit_identical(uninterrupted, tmp_path):
    result, ckpt = uninterrupted
    first = train_lm.main(
        [
            *TINY,
            "--checkpoint",
            "dots",
            "--ckpt-dir",
            str(tmp_path),
            "--stop-after",
            "3",
        ]
    )
    assert first.first_step == 0 and len(first.losses) == 3
    assert int(first.state.step) == 3
    # The run's options (model, optimiser, data, steps) come from the checkpoint.
    args = ["--resume", "--ckpt-dir", str(tmp_path), "--no-progress"]
    second = train_lm.main([*args, "--checkpoint", "dots", "--eval-batches", "0"])
    assert second.first_step == 3
    assert first.losses + second.losses == result.losses  # exact float equality
    for a, b in zip(arrays(second.state), arrays(result.state), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    # The final checkpoints are the same file, byte for byte.
    assert (tmp_path / train_lm.CHECKPOINT_FILE).read_bytes() == ckpt.read_bytes()


def test_switching_the_checkpoint_keeps_the_loss_curve(uninterrupted, tmp_path):
    """Resume a `"dots"` run under `recursive()`: only memory and FLOPs change."""
    result, _ = uninterrupted
    ckpt_dir = str(tmp_path)
    first = train_lm.main(
        [*TINY, "--checkpoint", "dots", "--ckpt-dir", ckpt_dir, "--stop-after", "4"]
    )
    second = train_lm.main([*TINY, "--checkpoint", "recursive", "--ckpt-dir", ckpt_dir,
                            "--resume"])  # fmt: skip
    assert second.state.model.checkpoint == eqx_remat.recursive()
    np.testing.assert_allclose(
        first.losses + second.losses, result.losses, rtol=1e-5, atol=0
    )
    for a, b in zip(arrays(second.state), arrays(result.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("none", None),
        ("dots", "dots"),
        ("every:2", eqx_remat.every(2)),
        ("every:3:nothing", eqx_remat.every(3, policy="nothing")),
        ("nested:2", eqx_remat.nested(2)),
        ("recursive", eqx_remat.recursive()),
        ("nested:3:dots_no_batch", eqx_remat.nested(3, policy="dots_no_batch")),
        ("binomial:4", eqx_remat.binomial(4)),
        (" Binomial:4:dots ", eqx_remat.binomial(4, policy="dots")),
    ],
)
def test_parse_checkpoint(spec, expected):
    assert train_lm.parse_checkpoint(spec) == expected


@pytest.mark.parametrize(
    "spec, match",
    [
        ("dot", "Expected one of: none, a policy name \\(everything, nothing, dots"),
        ("every", "Expected one of"),
        ("every:two", "Invalid --checkpoint 'every:two'"),
        ("every:0", "every: k must be an int >= 1"),
        ("every:2:bogus", "every: invalid policy"),
        ("recursive:dots", "recursive\\(\\) takes no policy"),
    ],
)
def test_parse_checkpoint_errors(spec, match):
    with pytest.raises(train_lm.UsageError, match=match):
        train_lm.parse_checkpoint(spec)


def test_parse_mesh_errors():
    assert train_lm.parse_mesh("none") is None
    assert train_lm.parse_mesh("dp:1") == ("dp", 1)
    with pytest.raises(train_lm.UsageError, match="dp\\[:DEVICES\\] or fsdp"):
        train_lm.parse_mesh("tp:2")
    with pytest.raises(train_lm.UsageError, match="xla_force_host_platform_device"):
        train_lm.parse_mesh(f"fsdp:{jax.device_count() + 1}")


def test_resume_with_other_run_options_fails(uninterrupted):
    _, ckpt = uninterrupted
    args = ["--resume", "--ckpt-dir", str(ckpt.parent), "--steps", "9"]
    with pytest.raises(train_lm.UsageError, match="--steps: checkpoint has 8, got 9"):
        train_lm.main(args)


def test_resume_without_a_checkpoint_fails(tmp_path):
    with pytest.raises(train_lm.UsageError, match="no checkpoint at"):
        train_lm.main(["--resume", "--ckpt-dir", str(tmp_path)])


def test_save_is_atomic(tmp_path, monkeypatch):
    """A crash while writing leaves the previous checkpoint whole, and no temp
    file behind."""
    path = tmp_path / "checkpoint.eqx"
    header = {"format": train_lm.FORMAT}
    old = (jnp.arange(4.0), jnp.int32(1))
    train_lm.save_checkpoint(path, header, old)
    before = path.read_bytes()

    def crash(f, tree):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(eqx, "tree_serialise_leaves", crash)
    with pytest.raises(KeyboardInterrupt):
        train_lm.save_checkpoint(path, header, (jnp.zeros(4), jnp.int32(2)))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.eqx"]
    monkeypatch.undo()
    with open(path, "rb") as f:
        f.readline()
        loaded = eqx.tree_deserialise_leaves(f, old)
    assert np.array_equal(loaded[0], old[0]) and int(loaded[1]) == 1
