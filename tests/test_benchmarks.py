"""Each benchmark script runs end to end on a tiny preset and writes its results.

Nothing here times anything: the scripts run in subprocesses (their own JAX
configuration, as a user runs them) and the tests check the files they write.
"""

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="needs libtpu (the `tpu` extra) to compile for TPU v5e",
)


def run(script: str, *args: str) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def load(path: Path) -> dict:
    assert path.exists(), f"{path} was not written"
    return json.loads(path.read_text())


def check_files(out: Path, stem: str) -> dict:
    data = load(out / f"{stem}.json")
    assert "meta" in data and data["meta"]["command"].startswith("python benchmarks/")
    assert (out / f"{stem}.png").stat().st_size > 0
    with (out / f"{stem}.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(data["rows"])
    return data


def test_run_quick(tmp_path):
    stdout = run("run.py", "--quick", "--out", str(tmp_path))
    data = check_files(tmp_path, "sweep-cpu-quick")
    assert {"presets", "rows", "peers", "targets"} <= set(data)
    keys = {
        "group",
        "impl",
        "checkpoint",
        "temp_bytes",
        "argument_bytes",
        "output_bytes",
        "flops",
        "compile_s",
        "median_s",
        "loss",
        "temp_ratio",
        "time_ratio",
        "pareto",
    }
    for row in data["rows"]:
        assert keys <= set(row), keys - set(row)
    impls = {r["impl"] for r in data["rows"]}
    assert {"eqx_remat", "hand-written", "flax", "eqxi.scan"} <= impls
    # Same architecture and weights: every peer's loss equals ours.
    assert data["peers"] and all(p["losses_equal"] for p in data["peers"])
    assert {"name", "met", "measured"} <= set(data["targets"][0])
    assert "Targets" in stdout


def test_depth_scaling_quick(tmp_path):
    run("depth_scaling.py", "--quick", "--out", str(tmp_path))
    data = check_files(tmp_path, "depth_scaling_quick")
    assert {r["depth"] for r in data["rows"]} == {16, 64}
    for row in data["rows"]:
        assert {"schedule", "temp_bytes", "flops", "compile_s"} <= set(row)
    assert "recursive()" in data["memory_slopes"]["slopes"]


def test_compile_time_quick(tmp_path):
    run("compile_time.py", "--quick", "--out", str(tmp_path))
    data = check_files(tmp_path, "compile_time_quick")
    assert {(r["checkpoint"], r["layers"]) for r in data["rows"]} == {
        ("None", 2),
        ("None", 8),
    }
    assert set(data["ratio_deepest_to_shallowest"]) == {"None"}


@pytest.mark.slow
@needs_libtpu
def test_seed_claim_quick(tmp_path):
    run("seed_claim.py", "--quick", "--out", str(tmp_path))
    data = check_files(tmp_path, "seed_claim_quick")
    for row in data["rows"]:
        assert {
            "config",
            "checkpoint",
            "temp_bytes",
            "fits_16GiB",
            "temp_reduction_vs_None",
            "flops_overhead_vs_None",
        } <= set(row)


@pytest.mark.slow
@needs_libtpu
def test_run_quick_v5e(tmp_path):
    run("run.py", "--quick", "--target", "v5e", "--no-peers", "--out", str(tmp_path))
    data = check_files(tmp_path, "sweep-v5e-quick")
    assert all(r["target"] == "v5e:2x2" for r in data["rows"])
    assert all("median_s" not in r for r in data["rows"])


@pytest.mark.slow
def test_run_budget_quick(tmp_path):
    stdout = run(
        "run.py",
        "--quick",
        "--preset",
        "chain-tiny",
        "--budget",
        "1MiB",
        "--checkpoints",
        "None",
        "recursive()",
        "--out",
        str(tmp_path),
    )
    data = load(tmp_path / "plan-cpu.json")
    (plan,) = data["plans"]
    assert plan["chosen"] in ("None", "recursive()")
    assert {e["checkpoint"] for e in plan["table"]} == {"None", "recursive()"}
    assert "checkpoint=" in stdout


@pytest.mark.slow
def test_binomial_vs_treeverse_tiny(tmp_path):
    out = tmp_path / "bvt.json"
    args = ["--depth", "16", "--width", "4", "--batch", "2", "--slots", "3"]
    run("binomial_vs_treeverse.py", *args, "--repeats", "1", "--json", str(out))
    (row,) = load(out)["rows"]
    assert {"binomial", "treeverse", "optimum"} <= set(row)


@pytest.mark.slow
@needs_libtpu
def test_v5e_stack_tiny(tmp_path):
    out = tmp_path / "v5e_stack.json"
    args = ["--d-model", "128", "--layers", "2", "--heads", "2", "--seq", "64"]
    run(
        "v5e_stack.py",
        *args,
        "--batch",
        "4",
        "--checkpoint",
        "None",
        "--json",
        str(out),
    )
    assert {"checkpoint", "fits"} <= set(load(out)[0])


def test_report_reads_committed_results(tmp_path):
    results = BENCH / "results"
    if not (results / "sweep-cpu.json").exists():
        pytest.skip("no committed results")
    stdout = run("report.py", "--results", str(results), "--no-write")
    assert "### CPU sweep" in stdout and "### Summary" in stdout
