"""The benchmark scripts: one command line, checked flags, the device they run on,
and each script end to end on a tiny preset.

Nothing here times anything: the scripts run in subprocesses (their own JAX
configuration, as a user runs them) and the tests check the files they write.
"""

import argparse
import contextlib
import csv
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import jax
import pytest
import tyro
from helpers import needs_libtpu, run_script as run

import eqx_remat as er
import zoo
from benchmarks import (
    _cli,
    _console,
    _device,
    _measure,
    _models,
    _peers,
    _plots,
    _results,
    _targets,
)
from benchmarks.train import config


ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
DEVICE_FIELDS = {"device_kind", "peak_bytes", "step_s", "mfu", "hfu"}


def check_files(out: Path, stem: str) -> dict:
    data = json.loads((out / f"{stem}.json").read_text())
    assert data["meta"]["command"].startswith("python benchmarks/")
    assert {"date", "versions", "device", "cpu_count"} <= set(data["meta"])
    assert (out / f"{stem}.png").stat().st_size > 0
    with (out / f"{stem}.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(data["rows"])
    return data


@pytest.mark.heavy
def test_run_quick(tmp_path):
    stdout = run("run.py", "--quick", "--out", str(tmp_path)).stdout
    data = check_files(tmp_path, "sweep-cpu-quick")
    for row in data["rows"]:
        assert DEVICE_FIELDS | {"temp_bytes", "flops", "temp_ratio", "fits"} <= set(row)
        assert {"tokens_per_s", "examples_per_s"} & set(row)
        # The CPU measures no peak memory and has no peak FLOP/s: null, not a guess.
        assert row["device_kind"] == "cpu" and row["peak_bytes"] is None
        assert row["mfu"] is None and row["hfu"] is None and row["step_s"] > 0
    assert {"eqx_remat", "hand-written", "flax", "eqxi.scan"} <= {
        r["impl"] for r in data["rows"]
    }
    # Same architecture and weights: every peer's loss equals ours.
    assert data["peers"] and all(p["losses_equal"] for p in data["peers"])
    names = [t["name"] for t in data["targets"]]
    assert any(
        "2 layers' parameters" in n for n in names
    )  # the parameter-dominated one
    assert all({"met", "threshold", "measured"} <= set(t) for t in data["targets"])
    assert "Targets" in stdout and "n/a" in stdout


@pytest.mark.heavy
def test_variant_that_does_not_fit_is_a_row(tmp_path):
    args = [
        "--preset",
        "chain-tiny",
        "--checkpoint",
        "None",
        "recursive()",
        "--no-peers",
        "--memory-limit",
        "1KiB",
        "--out",
        str(tmp_path),
    ]
    stdout = run("run.py", *args).stdout
    rows = json.loads((tmp_path / "sweep-cpu.json").read_text())["rows"]
    assert [r["fits"] for r in rows] == [False, False]
    assert all("limit" in r["error"] and r["step_s"] is None for r in rows)
    assert "no: compiled size" in stdout


@pytest.mark.heavy
def test_each_variant_in_its_own_process(tmp_path):
    """What runs on an accelerator (one process per variant), run on the CPU."""
    args = [
        "--preset",
        "chain-tiny",
        "--checkpoint",
        "None",
        "recursive()",
        "--no-peers",
        "--isolate",
        "always",
        "--repeats",
        "1",
    ]
    run("run.py", *args, "--out", str(tmp_path))
    rows = json.loads((tmp_path / "sweep-cpu.json").read_text())["rows"]
    assert [r["checkpoint"] for r in rows] == ["None", "recursive()"]
    assert all(
        r["fits"] and r["step_s"] > 0 and r["device_kind"] == "cpu" for r in rows
    )


@pytest.mark.heavy
def test_seed_claim_run_mode_on_cpu(tmp_path):
    """The real-run mode of the seed claim (a TPU's default), on a tiny config."""
    args = ["--quick", "--run", "--checkpoint", "None", "dots", "--repeats", "1"]
    run("seed_claim.py", *args, "--out", str(tmp_path))
    data = check_files(tmp_path, "seed_claim_quick_run")
    assert [r["checkpoint"] for r in data["rows"]] == ["None", "dots"]
    assert all(DEVICE_FIELDS | {"tokens_per_s"} <= set(r) for r in data["rows"])
    assert any("'dots' temp memory" in t["name"] for t in data["targets"])


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("run.py", ["--repeats", "-1"], "expected a positive integer"),
        ("run.py", ["--memory-limit", "16XB"], "such as '16GiB'"),
        ("run.py", ["--checkpoint", "every(x)"], "expected an integer"),
        ("run.py", ["--checkpoint", "dot"], "every(k[, policy])"),
        ("run.py", ["--target", "v7x"], "v5e:AxB"),
        ("run.py", ["--preset", "nope"], "invalid choice"),
        ("run.py", ["--device", "tpu"], "no tpu device"),
        ("seed_claim.py", ["--repeats", "0"], "expected a positive integer"),
        ("depth_scaling.py", ["--depths", "0"], "expected a positive integer"),
        ("compile_time.py", ["--checkpoint", "nested(two)"], "expected an integer"),
    ],
    ids=[
        "repeats",
        "memory-limit",
        "spec-arg",
        "spec-name",
        "target",
        "preset",
        "device",
        "seed-repeats",
        "depths",
        "compile-spec",
    ],
)
def test_bad_flags_exit_2_before_any_work(tmp_path, script, args, message):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = run(script, *args, "--out", str(tmp_path), rc=2, env=env)
    assert "error:" in proc.stderr and message in proc.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("profile_step", ["--quick", "--d-model", "30"], "argument --d-model: must "
         "be divisible by 4, the number of heads. Got 30."),
        ("seed_claim", ["--quick", "--preset", "2x2"], "argument --preset: --quick "
         "measures its own grid, which holds only tiny: leave out --preset or"),
        ("batch_sweep", ["--preset", "chain-tiny"], "--preset chain-tiny: expected "
         "a zoo.Transformer preset"),
        ("run", ["--heartbeat-timeout", "1"], "argument --heartbeat-timeout: needs "
         "--distributed."),
        ("seed_claim", ["--heartbeat-timeout", "1"], "argument --heartbeat-timeout: "
         "needs --distributed."),
        # A checkpoint that cannot checkpoint the stack it would run on.
        ("run", ["--preset", "transformer-tiny", "--checkpoint", "ranges(4:dots)"],
         "--checkpoint ranges(4:dots) on --preset transformer-tiny (2 layers): "
         "ranges expected counts that add up to the depth"),
        ("compile_time", ["--quick", "--checkpoint", "ranges(3:dots)"],
         "--checkpoint ranges(3:dots) on --depths 2 (2 layers)"),
        ("profile_step", ["--quick", "--checkpoint", "every:sqrt", "ranges(3:dots)"],
         "--checkpoint ranges(3:dots) on --layers (2 layers)"),
        # Flags that act where steps run, where nothing runs.
        ("seed_claim", ["--quick", "--memory-limit", "1KiB"],
         "--memory-limit has no effect without --run (AOT for v5e): nothing runs."),
        pytest.param("run", ["--quick", "--target", "v5e", "--repeats", "9"],
                     "--repeats has no effect with --target", marks=needs_libtpu),
        pytest.param("plan_sweep", ["--target", "v5e", "--no-clock"],
                     "--no-clock has no effect with --target", marks=needs_libtpu),
        pytest.param("plan_sweep", ["--target", "v5e", "--preset", "encoder-decoder"],
                     "--preset encoder-decoder: a preset of several stacks is "
                     "measured by the clock", marks=needs_libtpu),
        # Each stack of a preset of several is checked.
        ("plan_sweep", ["--preset", "encoder-decoder", "--checkpoint",
                        "ranges(6:dots)"],
         "--checkpoint ranges(6:dots) on --preset encoder-decoder "
         ".decoder.checkpoint (3 layers)"),
        pytest.param("batch_sweep", ["--target", "v5e", "--quick"],
                     "--quick has no effect with --target", marks=needs_libtpu),
        # A slice that TPU v5e does not come in, before any compile.
        pytest.param("run", ["--target", "v5e:3x3"], "argument --target: Unknown "
                     "target 'v5e:3x3': TPU v5e comes in slices of 1x1, 2x2"),
    ],
    ids=["d-model", "quick-preset", "batch-preset", "heartbeat", "heartbeat-seed",
         "ranges-run", "ranges-compile", "ranges-profile", "aot-memory-limit",
         "aot-repeats", "aot-no-clock", "aot-stacks", "ranges-stacks", "aot-quick",
         "slice"],
)  # fmt: skip
def test_bad_flags_in_main_exit_2_before_any_work(
    script, args, message, tmp_path, monkeypatch, capsys
):
    """What the parser alone cannot see, checked by `main` as argparse would."""
    import importlib

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # profile_step
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{script}.py"])
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"benchmarks.{script}").main(
            [*args, "--out", str(tmp_path / "out")]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: "), err
    assert f"{script}.py: error: {message}" in err, err
    assert not (tmp_path / "out").exists()


def test_an_unwritable_out_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    from benchmarks import run as run_py

    (tmp_path / "file").write_text("")
    monkeypatch.setattr(sys, "argv", ["benchmarks/run.py"])
    with pytest.raises(SystemExit) as e:
        run_py.main(["--quick", "--out", str(tmp_path / "file" / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "run.py: error: --out " in err, err
    assert "cannot write there: Not a directory" in err


def test_quick_keeps_the_flags_given(monkeypatch):
    """`--quick` sets only what is not given (it replaced --depths, --repeats,
    --checkpoint and --d-model with its own)."""
    from benchmarks import compile_time

    class Swept(Exception):
        pass

    def sweep(console, repeats, points, measure, key):
        raise Swept(repeats, sorted(points))

    monkeypatch.setattr(compile_time._depth, "sweep", sweep)
    argv = ["--quick", "--depths", "3", "5", "--repeats", "2", "--checkpoint", "dots"]
    with pytest.raises(Swept) as e:
        compile_time.main(argv)
    assert e.value.args == (2, [("dots", 3), ("dots", 5)])
    with pytest.raises(Swept) as e:
        compile_time.main(["--quick"])
    assert e.value.args == (1, [("None", 2), ("None", 8)])


def test_heartbeat_timeout_defaults_to_100_with_distributed():
    p = argparse.ArgumentParser(prog="x")
    _device.add_device_args(p)
    settings = _device.distributed_settings(p.parse_args(["--distributed"]), p)
    assert settings["heartbeat_timeout_seconds"] == 100
    assert "(default: 100)" in p.format_help()


def test_seed_claim_run_measures_each_preset_given(tmp_path, monkeypatch):
    """`--run --preset A B` runs A's variants, then B's (not only A's)."""
    from benchmarks import seed_claim

    class Measured(Exception):
        pass

    def measure(args, variants, console):
        raise Measured([(v.group, v.checkpoint) for v in variants])

    monkeypatch.setattr(seed_claim._measure, "measure_all", measure)
    argv = ["--run", "--preset", "d2560", "batch16", "--checkpoint", "None", "dots"]
    with pytest.raises(Measured) as e:
        seed_claim.main([*argv, "--out", str(tmp_path)])
    assert e.value.args[0] == [
        ("d2560", "None"),
        ("d2560", "dots"),
        ("batch16", "None"),
        ("batch16", "dots"),
    ]


def test_report_skips_a_partial_file_and_refuses_an_empty_directory(
    tmp_path, monkeypatch, capsys
):
    """An interrupted seed claim's `{"rows": ...}` is skipped with a note naming
    it, the rest is reported; a directory without results is an `error:`."""
    from benchmarks import report

    (tmp_path / "seed_claim.json").write_text('{"rows": []}')
    (tmp_path / "compile_time.json").write_text(
        (_results.RESULTS / "compile_time.json").read_text()
    )
    report.main(["--results", str(tmp_path), "--no-write"])
    out, err = capsys.readouterr()
    assert f"skipped {tmp_path / 'seed_claim.json'}: partial" in err
    assert "### Compile time" in out and "### Summary" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(sys, "argv", ["benchmarks/report.py"])
    with pytest.raises(SystemExit) as e:
        report.main(["--results", str(empty)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: report.py")
    assert f"report.py: error: --results {empty}: no results files" in err
    assert not any(empty.iterdir())


def test_auto_picks_the_cpu_without_libtpu_noise():
    """With libtpu installed (the `tpu` extra) and no TPU, `--device auto` settles
    on the CPU and libtpu prints nothing."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = (
        "from benchmarks import _cli\n"
        "args = _cli.parse_args(_cli.parser('x'), ['--device', 'auto'], 'x')\n"
        "import jax; print(jax.default_backend(), args.platform)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["cpu", "cpu"]
    for noise in ("TPU", "libtpu", "accelerator type", "worker hostname"):
        assert noise not in proc.stderr, proc.stderr


def test_sweep_explains_the_columns_it_shows_and_its_strict_targets():
    """run.py's legend explains each column its tables print, and no other
    (the CPU's tables have no peak, MFU or HFU); the strict form of a target
    that has a relaxed twin says so beside its verdict."""
    from benchmarks import _table, _targets, run as sweep

    def explained_cpu(sweep) -> set[str]:
        text = "\n".join(_printed(sweep.show, _committed("sweep-cpu"), "here"))
        legend = text[text.index("Columns: ") :]
        return {c.name for c in sweep.COLUMNS if f" {c.name} = " in legend}

    for stem in ("sweep-cpu", "sweep-cuda"):
        data = _committed(stem)
        text = "\n".join(_printed(sweep.show, data, "here"))
        legend = text[text.index("Columns: ") :]
        rows = _table.read_all(sweep.Row, data["rows"])
        shown = {
            c.name
            for n in data["presets"]
            for c in _table.shown(sweep.COLUMNS[1:], [r for r in rows if r.group == n])
            if c.means
        }
        explained = {c.name for c in sweep.COLUMNS if f" {c.name} = " in legend}
        assert explained == shown, (stem, explained ^ shown)
    assert not {"peak", "MFU", "HFU"} & explained_cpu(sweep)
    assert {"peak", "MFU", "HFU"} <= explained
    rows = _committed("sweep-cpu")["rows"]

    class Preset:
        def layer_param_bytes(self):
            return 0

    (strict,) = _targets.every_checkpoint(rows, "chain-params", Preset())
    assert "relaxed one below" in strict["why"], strict
    (other,) = _targets.every_checkpoint(rows, "chain-s", Preset())
    assert other["why"] == ""


@pytest.mark.parametrize("stem", ["sweep-cpu", "sweep-cuda", "sweep-v5e"])
def test_committed_verdicts_are_the_targets_judged_on_the_rows(stem):
    from benchmarks import _targets

    data = _committed(stem)
    presets = {n: _models.PRESETS[n] for n in data["presets"]}
    assert _targets.evaluate(data["rows"], presets) == data["targets"]


def test_every_target_the_cpu_sweep_misses_says_why():
    """Every target the committed CPU sweep misses has a note saying why
    (chain-params against treeverse: a parameter-dominated stack)."""
    from benchmarks import _targets

    data = _committed("sweep-cpu")
    presets = {n: _models.PRESETS[n] for n in data["presets"]}
    missed = [t for t in _targets.evaluate(data["rows"], presets) if t["met"] is False]
    assert len(missed) >= 3
    assert all(t["why"] for t in missed), [t["name"] for t in missed if not t["why"]]
    (params,) = [t for t in missed if "eqxi.scan (recursive)" in t["name"]]
    assert "parameter-dominated" in params["why"]


def test_plots_note_hidden_curves_narrow_axes_and_peers():
    """Curves drawn on top of each other are found (and said in the legend),
    a narrow range starts at zero, a chain panel names its peers' points, and
    a long figure title stays within the figure."""
    from benchmarks import run as sweep

    series = {"a": [1.0, 2.0], "b": [1.01, 2.0], "c": [3.0, 4.0], "d": [1.0, 2.0]}
    assert _plots.coinciding(series) == {"b": "a", "d": "a"}
    pyplot = _plots.plt()
    fig, ax = pyplot.subplots()
    ax.plot([0, 1], [1.02, 1.10])
    _plots.zero_based_if_narrow(ax, "y", [1.02, 1.10])
    assert ax.get_ylim()[0] == 0
    ax.set_ylim(1, 100)
    _plots.zero_based_if_narrow(ax, "y", [1.0, 100.0])
    assert ax.get_ylim() == (1, 100)
    _plots.suptitle(
        fig, "Planner sweep: 10 budgets, TPU v5e 2x4, 16 GiB per chip; " * 8
    )
    fig.canvas.draw()
    title = fig._suptitle.get_window_extent()  # type: ignore[attr-defined]
    assert 0 <= title.x0 and title.x1 <= fig.bbox.x1, (title, fig.bbox)
    pyplot.close(fig)
    data = json.loads((ROOT / "benchmarks/results/sweep-cpu.json").read_text())
    fig, ax = pyplot.subplots()
    labelled, _ = sweep._plot_preset(ax, data, "chain-s", "time_ratio")
    assert any(text.startswith("eqxi.scan (") for _, _, text in labelled)
    pyplot.close(fig)


def test_peak_flops_by_device_kind():
    assert _device.peak_flops_per_chip("TPU v5 lite") == 197e12
    assert _device.peak_flops_per_chip("TPU v6 lite") == 918e12
    assert _device.peak_flops_per_chip("NVIDIA H100 80GB HBM3") == 989e12
    assert _device.peak_flops_per_chip("cpu") is None
    assert _device.peak_flops_per_chip("TPU v99") is None
    u = _device.utilisation(197e12, 1.0, kind="TPU v5 lite", devices=4)
    assert u == pytest.approx(0.25)
    assert _device.utilisation(1e12, 1.0, kind="cpu", devices=1) is None
    assert _device.utilisation(None, 1.0, kind="TPU v5 lite", devices=1) is None


def test_only_process_0_writes(tmp_path, monkeypatch, capsys):
    import argparse

    import jax

    args = argparse.Namespace(out=tmp_path)
    data = {"rows": [{"a": 1}]}
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert _results.write(args, "x", data, lambda d, p: p.write_text("png")) is None
    _console.Console().print("hello from process 1")
    assert not any(tmp_path.iterdir()) and "hello" not in capsys.readouterr().out
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    assert _results.write(args, "x", data, lambda d, p: p.write_text("png")).exists()


def _parsers() -> dict:
    """Every script's parser, built without running anything."""
    from benchmarks import (
        batch_sweep,
        compile_time,
        depth_scaling,
        maxtext_mfu,
        mesh_sweep,
        plan_sweep,
        profile_step,
        report,
        run as sweep,
        seed_claim,
    )

    return {
        "run.py": sweep._parser(),
        "seed_claim.py": seed_claim._parser(),
        "depth_scaling.py": depth_scaling._parser(),
        "compile_time.py": compile_time._parser(),
        "report.py": report._parser(),
        "plan_sweep.py": plan_sweep._parser(),
        "batch_sweep.py": batch_sweep._parser(),
        "profile_step.py": profile_step._parser(),
        "maxtext_mfu.py": maxtext_mfu._parser(),
        "mesh_sweep.py": mesh_sweep._parser(),
        "train_lm.py": _TrainFlags(),
    }


class _TrainFlags:
    """train_lm.py's command line (tyro's, from `config.Flags`), as far as these
    tests use a parser."""

    def parse_args(self, argv):
        return config.parse_args(argv)

    def format_help(self) -> str:
        with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as f:
            config.parse_args(["--help"])
        return f.getvalue()


def _flags(parser) -> set[str]:
    if isinstance(parser, _TrainFlags):
        # Every field but `run` (the RunConfig, whose fields are flags of their
        # own) and those tyro suppresses (set by the script, never spelt out).
        names = {f.name for f in dataclasses.fields(config.RunConfig)}
        hints = typing.get_type_hints(config.Flags, include_extras=True)
        for f in dataclasses.fields(config.Flags):
            if f.name != "run" and tyro.conf.Suppress not in getattr(
                hints[f.name], "__metadata__", ()
            ):
                names.add(f.name)
        return {"--" + n.replace("_", "-") for n in names}
    return {
        f
        for a in parser._actions
        if a.help != argparse.SUPPRESS
        for f in a.option_strings
        if f.startswith("--") and f != "--help"
    }


def _readme_tables() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """From benchmarks/README.md's "One command line": which script takes which
    shared flag (the ✓ matrix), and each script's own flags."""
    text = (BENCH / "README.md").read_text()
    section = text.split("## One command line", 1)[1].split("\n## ", 1)[0]
    tables, current = [], None
    for line in section.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if current is None:
            current = {"header": cells, "rows": []}
            tables.append(current)
        elif not set(line) <= set("|-"):
            current["rows"].append(cells)
    matrix, own = tables
    scripts = [c.strip("`") for c in matrix["header"][2:]]
    shared = {s: set() for s in scripts}
    for cells in matrix["rows"]:
        for script, mark in zip(scripts, cells[2:], strict=True):
            assert mark in ("✓", ""), (script, cells[0], mark)
            if mark:
                shared[script] |= set(re.findall(r"`(--[a-z][a-z0-9-]*)", cells[0]))
    own_flags = {
        cells[0].strip("`"): set(re.findall(r"`(--[a-z][a-z0-9-]*)", cells[1]))
        for cells in own["rows"]
    }
    return shared, own_flags


def test_readme_flag_tables_match_the_parsers():
    shared, own = _readme_tables()
    parsers = _parsers()
    assert set(shared) == set(own) == set(parsers)
    for script, parser in parsers.items():
        assert "--help" in parser.format_help()  # every help string formats
        flags = _flags(parser)
        assert shared[script] | own[script] == flags, (
            script,
            "in the README, not the parser:",
            sorted((shared[script] | own[script]) - flags),
            "in the parser, not the README:",
            sorted(flags - shared[script] - own[script]),
        )
        assert not shared[script] & own[script], script


@pytest.mark.parametrize("script", ["run.py", "seed_claim.py", "depth_scaling.py",
                                    "compile_time.py", "train_lm.py"])  # fmt: skip
def test_every_checkpoint_flag_takes_the_colon_spelling(script, capsys):
    parser = _parsers()[script]
    flag = "--remat" if script == "train_lm.py" else "--checkpoint"
    for spec in ("every:4", "every:4:dots", "binomial:8", "recursive", "nested:3",
                 "every(4, dots)", "ranges(4:dots, 12:every:3)"):  # fmt: skip
        assert getattr(parser.parse_args([flag, spec]), flag[2:]) in (spec, [spec])
    with pytest.raises(SystemExit) as e:
        parser.parse_args([flag, "every:two"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "'every:two'" in err and "got 'two'" in err


def test_no_train_lm_flag_named_checkpoint():
    """`--remat` (how blocks are rematerialised) and `--save-dir` (where Orbax
    checkpoints go): "checkpoint" means one thing in a train_lm command."""
    flags = _flags(_parsers()["train_lm.py"])
    assert {"--remat", "--save-dir"} <= flags
    assert not {f for f in flags if "checkpoint" in f or "ckpt" in f}
    command = re.compile(r"train_lm\.py[^`|\n]*--(checkpoint|ckpt-dir)\b")
    for path in [ROOT / "README.md", BENCH / "README.md", *ROOT.glob("docs/**/*.md")]:
        assert command.search(path.read_text()) is None, path


def _printed(show, *args) -> list[str]:
    """The lines `show(console, *args)` prints into a 100-column console."""
    from rich.console import Console as Rich

    console = _console.Console()
    console.rich = Rich(width=100, record=True)
    show(console, *args)
    return console.rich.export_text().splitlines()


def _committed(stem: str) -> dict:
    return json.loads((_results.RESULTS / f"{stem}.json").read_text())


def test_sweep_tables_fit_100_columns():
    """The committed CPU sweep, printed as `run.py` prints it: no line wider than
    100 columns, no column `n/a` in every row (peak, MFU, HFU on a CPU)."""
    from benchmarks import _table, run as sweep

    data = _committed("sweep-cpu")
    lines = _printed(sweep.show, data, "cpu x1, run")
    assert lines and max(map(len, lines)) <= 100
    text = "\n".join(lines)
    assert "…" not in text  # nothing cut short
    for header in ("temp", "temp/None", "FLOPs", "ms", "rate"):
        assert header in text
    for header in ("peak", "MFU", "HFU"):
        assert header not in text
    rows = _table.read_all(sweep.Row, data["rows"])
    for n in data["presets"]:
        mine = [r for r in rows if r.group == n]
        shown = _table.shown(sweep.COLUMNS[1:], mine)
        assert [c.name for c in shown][:2] == ["impl", "checkpoint"]
        for c in shown:
            assert any(str(c.cell(r)) != "n/a" for r in mine), (n, c.name)


def test_other_tables_fit_100_columns():
    from benchmarks import depth_scaling, seed_claim

    depth = _committed("depth_scaling")
    printed = {
        "depth_scaling": _printed(
            depth_scaling.show, depth, list(depth["memory_slopes"]["slopes"])
        ),
        "seed_claim": _printed(seed_claim.show, _committed("seed_claim"), "here"),
    }
    for name, lines in printed.items():
        assert len(lines) > 5 and max(map(len, lines)) <= 100, name
        assert "…" not in "\n".join(lines), name


def test_all_na_columns_are_not_shown():
    columns = ("a", "b", "c", "d")
    rows = [("x", "n/a", "1", ""), ("y", "n/a", "n/a", "")]
    assert _console.shown_columns(columns, rows) == [0, 2]
    assert _console.shown_columns(columns, []) == [0, 1, 2, 3]


def test_results_are_not_overwritten_by_default():
    args = _cli.parse_args(_cli.parser("x"), ["--device", "cpu"], "x")
    assert args.out.parent == _results.RUNS and not args.out.exists()
    args = _cli.parse_args(
        _cli.parser("x"), ["--device", "cpu", "--update-results"], "x"
    )
    assert args.out == _results.RESULTS


@pytest.mark.heavy
def test_depth_scaling_quick(tmp_path):
    run("depth_scaling.py", "--quick", "--out", str(tmp_path))
    data = check_files(tmp_path, "depth_scaling_quick")
    assert {r["depth"] for r in data["rows"]} == {16, 64}
    assert all(
        {"spec", "temp_bytes", "flops", "compile_s"} <= set(r) for r in data["rows"]
    )
    assert "recursive()" in data["memory_slopes"]["slopes"]


@pytest.mark.heavy
def test_compile_time_quick(tmp_path):
    run("compile_time.py", "--quick", "--out", str(tmp_path))
    data = check_files(tmp_path, "compile_time_quick")
    assert {(r["checkpoint"], r["layers"]) for r in data["rows"]} == {
        ("None", 2),
        ("None", 8),
    }
    assert data["targets"][0]["met"] in (True, False)


def _temp_vs_flax(preset, policy, target=None):
    """Compiled temp bytes of `value_and_grad` of the loss: (ours, Flax linen's),
    the same weights."""
    model = preset.build(abstract=True)
    tokens = preset.inputs(abstract=True)
    if target is not None:
        mesh = er.v5e_mesh(target)
        model = zoo.shard(model, mesh)
        tokens = _measure.place_batch(tokens, mesh)
    out = []
    for make in (_models.ours, _peers.flax_transformer):
        # Flax's LayerNorm mixes bfloat16 and float32 implicitly.
        with jax.numpy_dtype_promotion("standard"):
            fn, params = make(preset, model, policy)
            report = er.memory_report(fn, params, tokens, target=target)
        out.append(report.temp_bytes)
    return out


@pytest.mark.heavy
@pytest.mark.parametrize("policy", _peers.TRANSFORMER_POLICIES)
def test_transformer_temp_memory_at_most_flax(policy):
    """A target: `zoo.Transformer` uses no more temp memory than Flax linen's
    `nn.scan(nn.remat(...))` under each policy (CPU)."""
    preset = _models.PRESETS["transformer-tiny"]
    ours, flax = _temp_vs_flax(preset, er.parse_checkpoint(policy))
    assert ours <= flax


@pytest.mark.slow
@needs_libtpu
def test_transformer_temp_memory_at_most_flax_v5e():
    """The same on TPU v5e, at a size where the TPU compiler's layouts matter: with
    `(out, in)` weights (`equinox.nn.Linear`'s) it kept a re-laid-out copy of each
    recomputed layer input under `"nothing"` (+8 MiB per chip here)."""
    preset = dataclasses.replace(
        _models.PRESETS["transformer-v5e"], layers=2, vocab=1024
    )
    ours, flax = _temp_vs_flax(preset, "nothing", target="v5e")
    assert ours <= flax


@pytest.mark.slow
@needs_libtpu
def test_seed_claim_quick_aot(tmp_path):
    run("seed_claim.py", "--quick", "--out", str(tmp_path))
    data = check_files(tmp_path, "seed_claim_quick")
    assert all(
        {"temp_bytes", "fits", "temp_ratio", "flops_ratio"} <= set(r)
        for r in data["rows"]
    )


@pytest.mark.slow
@needs_libtpu
def test_run_quick_v5e(tmp_path):
    stdout = run(
        "run.py", "--quick", "--target", "v5e", "--no-peers", "--out", str(tmp_path)
    ).stdout
    data = check_files(tmp_path, "sweep-v5e-quick")
    assert all(r["target"] == "v5e" and r["step_s"] is None for r in data["rows"])
    assert "compiled, not run" in stdout


def test_aot_beside_names_the_slice_of_every_chip_count():
    """On a v5e host, the measured peak is set beside the AOT estimate for
    that host's own slice: each slice v5e comes in, by its chip count (a
    count no slice has is an error in the row, never another slice)."""
    from eqx_remat._inspect._targets import V5E_SLICES

    shapes = {
        n: er.internal.slice_shape(f"v5e:{s}") for n, s in _measure._TOPOLOGY.items()
    }
    assert sorted(shapes.values()) == sorted(V5E_SLICES)
    assert all(a * b == n for n, (a, b) in shapes.items())


@pytest.mark.heavy
def test_batch_sweep_runs_the_pick_beside_every_combination(tmp_path):
    """transformer-tiny (batch 2): every (uniform checkpoint x micro-batches x
    loss chunking) is compiled and timed; at each budget the plan's pick
    fits, is raced with the fastest fitting combinations, and the targets
    are judged on it. Two of the four uniform checkpoints, the ends that set
    the budgets (None, the heaviest, and "nothing"): the others add only
    compiles."""
    args = ["--quick", "--budgets", "2", "--repeats", "2"]
    args += ["--checkpoint", "None", "nothing"]
    run("batch_sweep.py", *args, "--out", str(tmp_path))
    data = check_files(tmp_path, "batch_sweep-cpu")
    combos = [r for r in data["rows"] if r["kind"] == "combination"]
    assert len(combos) == 2 * 2 * 2  # 2 checkpoints x (1, 2) x (whole, chunked)
    assert {r["checkpoint"] for r in combos} == {"None", "'nothing'"}
    picks = [r for r in data["rows"] if r["kind"] == "pick"]
    assert len(picks) == 2
    for r in picks:
        assert r["fits"] and r["memory_bytes"] <= r["budget_bytes"], r
        assert r["micro_batches"] in (1, 2) and r["ratio"] > 0
    assert picks[0]["plain_plan_s"] > 0
    assert {t["target"].split(" <=")[0] for t in data["targets"]} == {
        "measured: pick",
        "planning a batch",
    }


@pytest.mark.heavy
def test_plan_sweep_quick(tmp_path):
    proc = run(
        "plan_sweep.py",
        "--quick",
        "--budgets",
        "3",
        "--repeats",
        "3",
        "--out",
        str(tmp_path),
    )
    data = check_files(tmp_path, "plan_sweep-cpu-quick")
    rows = data["rows"]
    (planning,) = [r for r in rows if r["kind"] == "planning"]
    assert planning["budgets"] >= 3 and planning["compiles"] >= 1
    assert planning["seconds"] > 0 and planning["load_average"] >= 0
    uniform = {r["checkpoint"]: r for r in rows if r["kind"] == "uniform"}
    assert set(uniform) == {"None", "dots"}
    picks = [r for r in rows if r["kind"] == "pick"]
    budgets = [r["budget_bytes"] for r in picks]
    # From the lightest option's compiled memory to above None's (on the device,
    # None fits the top budget and still need not be the pick), and half-way
    # between uniform points of the frontier.
    assert len(budgets) == planning["budgets"] >= 3 and budgets == sorted(budgets)
    assert budgets[-1] == int(uniform["None"]["memory_bytes"] * 1.1)
    for r in picks:
        assert r["fits"] and r["compiled_bytes"] <= r["budget_bytes"], r
    frontier = [r for r in rows if r["kind"] == "frontier"]
    memories = [r["memory_bytes"] for r in frontier]
    times = [r["time_s"] for r in frontier]
    assert memories == sorted(memories) and times == sorted(times, reverse=True)
    # On the device every frontier point, pick and uniform checkpoint is timed
    # afresh, beside the planner's prediction and the roofline's.
    timed = {r["checkpoint"]: r for r in rows if r["kind"] == "timed"}
    assert {r["checkpoint"] for r in picks} <= set(timed)
    assert {r["checkpoint"] for r in frontier} <= set(timed) and set(uniform) <= set(
        timed
    )
    for r in timed.values():
        assert r["measured_s"] > 0 and r["predicted_s"] > 0 and r["roofline_s"] > 0
    for r in picks:
        assert r["measured_s"] == timed[r["checkpoint"]]["measured_s"]
        assert r["best_uniform_measured_s"] > 0
    # How well two of the three rounds rank them, by the planner's statistic
    # and by the paired ratio (rank correlations with the third).
    (few,) = [r for r in rows if r["kind"] == "rounds"]
    assert few["rounds"] == 3 and few["k"] == [2]
    assert -1 <= few["faster_half"][0] <= 1 and -1 <= few["paired"][0] <= 1
    assert "rank correlation of k of 3 rounds" in proc.stdout
    # Every planner target has a verdict (or says it could not measure it),
    # stored with its threshold.
    names = [t["target"] for t in data["targets"]]
    assert len(names) == 9 and len(set(names)) == 9, names
    for t in data["targets"]:
        assert t["preset"] == "transformer-tiny" and t["met"] in (True, False, None)
        assert {"threshold", "value", "measured"} <= set(t)
    assert "Picks" in proc.stdout and "Targets" in proc.stdout
    assert "predicted against measured" in proc.stdout


@pytest.mark.heavy
def test_plan_sweep_two_stacks_quick(tmp_path):
    proc = run(
        "plan_sweep.py",
        "--quick",
        "--preset",
        "encoder-decoder-tiny",
        "--budgets",
        "2",
        "--repeats",
        "3",
        "--out",
        str(tmp_path),
    )
    # A results file of its own: --update-results leaves the single stacks' be.
    data = check_files(tmp_path, "plan_sweep-stacks-cpu-quick")
    rows = data["rows"]
    # Every combination of one uniform checkpoint per stack (the quick list,
    # None and "nothing", on each), compiled and timed.
    combos = {r["checkpoint"]: r for r in rows if r["kind"] == "combination"}
    assert set(combos) == {
        f"{a} / {b}" for a in ("None", "nothing") for b in ("None", "nothing")
    }
    paths = [".encoder.checkpoint", ".decoder.checkpoint"]
    for label, r in combos.items():
        assert list(r["checkpoints"]) == paths
        assert " / ".join(r["checkpoints"].values()) == label
        assert r["same"] == (len(set(r["checkpoints"].values())) == 1)
        assert r["memory_bytes"] > 0 and r["measured_s"] > 0 and r["times_s"]
    lightest, none = combos["nothing / nothing"], combos["None / None"]
    # Budgets from the least compiled memory to 1.1x every stack on None, and
    # half-way between neighbouring memories of one checkpoint everywhere.
    picks = [r for r in rows if r["kind"] == "pick"]
    budgets = [r["budget_bytes"] for r in picks]
    assert budgets == sorted(budgets) and budgets[0] <= lightest["memory_bytes"]
    assert budgets[-1] == int(1.1 * none["memory_bytes"])
    assert (lightest["memory_bytes"] + none["memory_bytes"]) // 2 in budgets
    for r in picks:
        # Fits, compiled by the planner and here alike.
        assert r["fits"] and r["compiled_bytes"] <= r["budget_bytes"], r
        assert r["memory_bytes"] == r["compiled_bytes"]
        assert list(r["checkpoints"]) == paths
        if r["checkpoint"] in combos:  # timed once, in the same rounds
            assert r["measured_s"] == combos[r["checkpoint"]]["measured_s"]
        # Beside the fastest fitting combination, and the fastest fitting one
        # checkpoint on every stack.
        fitting = [c for c in combos.values() if c["memory_bytes"] <= r["budget_bytes"]]
        best = min(fitting, key=lambda c: c["measured_s"])
        same = min((c for c in fitting if c["same"]), key=lambda c: c["measured_s"])
        assert r["best_combination"] == best["checkpoint"]
        assert r["best_same"] == same["checkpoint"]
        assert r["best_combination_s"] <= r["best_same_s"]
        assert r["combination_ratio"] > 0 and r["same_ratio"] > 0
        between = lightest["memory_bytes"] < r["budget_bytes"] < none["memory_bytes"]
        if none["measured_s"] > lightest["measured_s"]:  # None is off the frontier
            between = False
        assert r["same_between"] == between
    # The targets of several stacks, and none that needs a single stack's rows.
    names = {t["target"].split(" <=")[0].split(" at >=")[0] for t in data["targets"]}
    assert names == {
        "at every budget the pick fits when compiled",
        "pick's predicted memory within 5% of compiled",
        f"{len(budgets)} budgets planned in",
        "measured: pick",
        "measured: pick faster than one checkpoint on every stack",
    }, names
    assert "Several stacks by the clock" in proc.stdout
    assert "Uniform candidates" not in proc.stdout


def test_two_stack_targets_are_judged_on_the_picks_rows():
    """(b) the pick against the fastest fitting combination, every budget; (c)
    faster than one checkpoint on every stack at half the budgets between
    those points, counted only there."""
    preset = _models.PRESETS["encoder-decoder-tiny"]

    def pick(budget, combination_ratio, same_ratio, between):
        return {
            "group": "ed",
            "kind": "pick",
            "budget_bytes": budget,
            "fits": True,
            "compiled_bytes": budget,
            "spread": 0.01,
            "best_combination_s": 1.0,
            "combination_ratio": combination_ratio,
            "best_same_s": 1.0,
            "same_ratio": same_ratio,
            "same_between": between,
        }

    rows = [
        pick(10, 1.00, 1.00, False),
        pick(20, 1.02, 0.95, True),
        pick(30, 0.99, 1.01, True),
        pick(40, 1.00, 0.90, False),  # not between: not counted
    ]
    verdicts = {
        v["target"]: v
        for v in _targets.evaluate(rows, {"ed": preset}, _targets.PLAN_TARGETS)
    }
    vs_all = next(v for k, v in verdicts.items() if "fastest fitting combination" in k)
    assert vs_all["met"] and vs_all["value"] == 1.02
    vs_same = next(v for k, v in verdicts.items() if "one checkpoint on every" in k)
    assert vs_same["met"] and vs_same["value"] == 0.5
    assert vs_same["measured"].startswith("1 of 2 budgets (5.0%")
    rows[1]["combination_ratio"] = 1.05
    rows[1]["same_ratio"] = 1.0
    verdicts = _targets.evaluate(rows, {"ed": preset}, _targets.PLAN_TARGETS)
    assert [v["met"] for v in verdicts if "measured" in v["target"]] == [False, False]
    # A single stack's targets ask for keys these rows do not have: the pick
    # fits, and the two above.
    assert len(verdicts) == 3 and "pick fits" in verdicts[0]["target"]
    # With no budget between, (c) says why.
    for r in rows:
        r["same_between"] = False
    (v,) = [
        v
        for v in _targets.evaluate(rows, {"ed": preset}, _targets.PLAN_TARGETS)
        if "one checkpoint on every" in v["target"]
    ]
    assert v["met"] is None and v["why"] == _targets.NOTHING_BETWEEN_SAME


def test_spearman_ranks_with_ties_and_says_when_it_cannot():
    assert _targets.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert _targets.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ties share their mean rank: [1, 2.5, 2.5, 4] against [1, 2, 3, 4].
    assert _targets.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(
        0.9486833, rel=1e-6
    )
    assert _targets.spearman([1, 2], [1, 2]) is None  # too few to rank
    assert _targets.spearman([1, 1, 1], [1, 2, 3]) is None  # a constant side


def test_report_reads_committed_results():
    if not (BENCH / "results" / "sweep-cpu.json").exists():
        pytest.skip("no committed results")
    stdout = run("report.py", "--results", str(BENCH / "results"), "--no-write").stdout
    assert "### CPU sweep" in stdout and "### Summary" in stdout


def test_step_time_verdicts_note_cpu_noise_only_for_cpu_rows():
    """The step-time verdicts against peers say that CPU timings are noisy when
    the rows were measured on a CPU, and say nothing of a CPU for the same rows
    measured on a GPU."""
    data = json.loads((_results.RESULTS / "sweep-cpu.json").read_text())
    presets = {n: _models.PRESETS[n] for n in data["presets"]}

    def notes(rows):
        return {
            t["why"]
            for t in _targets.evaluate(rows, presets)
            if t["metric"] == "step_s"
        }

    assert notes(data["rows"]) == {_targets.NOISY}
    gpu = [{**r, "device_kind": "NVIDIA H100 80GB HBM3"} for r in data["rows"]]
    assert notes(gpu) == {""}


def test_profile_step_quick(tmp_path):
    """`profile_step.py --quick --trace` runs end to end and writes one row per
    checkpoint; what it saves across the stack shrinks from `None` to
    `"nothing"` (bytes only: nothing here is timed against anything)."""
    from benchmarks import profile_step

    profile_step.main(["--quick", "--trace", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "profile_step.json").read_text())
    rows = {r["checkpoint"]: r for r in data["rows"]}
    assert list(rows) == ["None", "dots", "nothing"]
    saved = [rows[c]["saved_bytes"] for c in rows]
    assert saved[0] > saved[1] > saved[2] > 0
    for r in rows.values():
        assert r["cpu_s"] > 0 and r["page_faults"] >= 0 and r["profile_s"]


def test_run_says_the_count_its_progress_bar_ends_at(monkeypatch):
    """run.py's header counts what its progress bar counts: with 56 variants
    timed in 5 rounds, both say 61 (the bar ended at 61/61 under a header of
    56 variants); in processes of their own, both say 56."""
    import argparse
    import contextlib

    totals = []

    class Console:
        @contextlib.contextmanager
        def progress(self, total):
            totals.append(total)
            yield lambda _: None

    monkeypatch.setattr(_measure, "measure_here", lambda *a, **k: [])
    monkeypatch.setattr(_measure, "measure_isolated", lambda *a, **k: [{}])
    variants = list(range(56))
    here = argparse.Namespace(target=None, deferred=False, repeats=5, memory_limit=None)
    apart = argparse.Namespace(target=None, deferred=True, repeats=5, argv=[])
    for args, n in ((here, 61), (apart, 56)):
        header = _measure.plan_of_work(args, variants, 5)
        _measure.measure_all(args, variants, Console())  # type: ignore[arg-type]
        assert totals[-1] == n and header.startswith("56 variants of 5 presets")
        assert f"({n} steps)" in header or (n == 56 and "own" in header), header


def test_seed_claim_hatches_exactly_the_bars_above_its_line():
    """seed_claim.png draws, per config and checkpoint, the memory per chip
    that XLA's verdict is about: a bar is hatched ("does not fit") where it
    stands above the 16 GiB line and only there (it drew temp memory alone:
    12layers / dots hatched at 14 GiB, 2x2 / nothing at 10 GiB); and each
    config's tick says what it changes."""
    from benchmarks import seed_claim

    data = _committed("seed_claim")
    drawn = seed_claim.bars(data)
    assert len(drawn) == len(data["rows"])
    for b in drawn:
        assert b.fits == (b.gib <= seed_claim.HBM_GIB), b
    base = data["presets"]["base"]
    assert seed_claim._change("2x2", data["presets"]["2x2"], base) == "v5e:2x2 slice"
    assert "d_model 3072" in seed_claim._change(
        "d3072-3B", data["presets"]["d3072-3B"], base
    )


# Each committed plot, and the script whose `plot(data, path)` draws it.
PLOTS = {
    "sweep-cpu": "run",
    "sweep-cuda": "run",
    "sweep-v5e": "run",
    "seed_claim": "seed_claim",
    "depth_scaling": "depth_scaling",
    "compile_time": "compile_time",
    "plan_sweep-cpu": "plan_sweep",
    "plan_sweep-cuda": "plan_sweep",
    "plan_sweep-v5e_2x4": "plan_sweep",
    "plan_sweep-v5e_16x16": "plan_sweep",
    "batch_sweep-cpu": "batch_sweep",
    "batch_sweep-v5e_2x4": "batch_sweep",
}


def _drawn(stem: str, monkeypatch):
    """The figure a script's `plot` draws from a committed results file (laid
    out as saved, not written)."""
    import importlib

    figures = []

    def keep(fig, path, rect=None):
        fig.tight_layout(rect=rect)
        figures.append(fig)

    monkeypatch.setattr(_plots, "save_figure", keep)
    importlib.import_module(f"benchmarks.{PLOTS[stem]}").plot(
        _committed(stem), Path("unused.png")
    )
    (fig,) = figures
    fig.canvas.draw()
    return fig


def _points(ax) -> list:
    """Every data point drawn on `ax`, in display coordinates."""
    import numpy as np

    xy = [ln.get_xydata() for ln in ax.lines if ln.get_marker() not in ("", "None")]
    xy += [c.get_offsets() for c in ax.collections if len(c.get_offsets())]
    xy = [np.asarray(a, dtype=float).reshape(-1, 2) for a in xy]
    xy = [a[np.isfinite(a).all(axis=1)] for a in xy]
    return [p for a in xy if len(a) for p in ax.transData.transform(a)]


@pytest.mark.parametrize("stem", list(PLOTS))
def test_every_committed_plot_reads_true(stem, monkeypatch):
    """Each plot as a reader sees it: a title within the figure that says the
    machine and date, both axis labels on every panel, no label on another
    or outside its panel, and no legend inside a panel over a point."""
    fig = _drawn(stem, monkeypatch)
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    title = fig._suptitle  # type: ignore[attr-defined]
    assert title is not None and _committed(stem)["meta"]["date"] in title.get_text()
    box = title.get_window_extent(renderer)
    assert 0 <= box.x0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1, stem
    texts = []
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel(), (stem, ax.get_title())
        for title in (ax.title, ax._left_title):  # type: ignore[attr-defined]
            box = title.get_window_extent(renderer)
            assert 0 <= box.x0 and box.x1 <= fig.bbox.x1, (stem, title.get_text())
        frame = ax.get_window_extent(renderer).padded(1)
        for t in ax.texts:
            extent = t.get_window_extent(renderer)
            inside = frame.x0 <= extent.x0 and extent.x1 <= frame.x1
            inside &= frame.y0 <= extent.y0 and extent.y1 <= frame.y1
            assert inside, (stem, t.get_text(), "outside its panel")
            texts.append((t.get_text(), extent))
        legend = ax.get_legend()
        if legend is not None:
            lbox = legend.get_window_extent(renderer)
            if frame.contains(lbox.x0, lbox.y0) and frame.contains(lbox.x1, lbox.y1):
                hidden = [p for p in _points(ax) if lbox.contains(*p)]
                assert not hidden, (stem, ax.get_title(), "legend over a point")
    for i, (a, ea) in enumerate(texts):
        for b, eb in texts[i + 1 :]:
            assert not ea.overlaps(eb), (stem, a, b)
    _plots.plt().close(fig)


def test_plots_join_only_measured_neighbours(monkeypatch):
    """compile_time.png measured 4 and 64 layers: points only, no line drawing
    8 to 32; depth_scaling.png's doublings are joined; a sweep's panel whose
    memory spans less than a fifth of its largest spreads its points over the
    panel (not one band at the top of an axis from zero) and says so."""
    fig = _drawn("compile_time", monkeypatch)
    styles = {
        ln.get_linestyle()
        for ax in fig.axes
        for ln in ax.lines
        if ln.get_label()[0] != "_"
    }
    assert styles <= {"None"}, styles
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["4", "64"]
    fig = _drawn("depth_scaling", monkeypatch)
    assert any(ln.get_linestyle() == "-" for ln in fig.axes[0].lines)
    fig = _drawn("sweep-cpu", monkeypatch)
    (ax,) = [
        a for a in fig.axes if a.get_title(loc="left").startswith("chain-params-n")
    ]
    ys = [y for _, y in _points(ax)]
    frame = ax.get_window_extent()
    assert max(ys) - min(ys) > 0.6 * frame.height
    assert "not from 0" in ax.get_ylabel()
