"""Markdown tables from results files, for `benchmarks/README.md`, and the
summary `summary.md` (every target verdict, which the top-level README quotes).
Nothing is measured or judged here: every number and verdict is read from the
JSON files the other scripts wrote.

    python benchmarks/report.py                          # benchmarks/results/
    python benchmarks/report.py --results DIR --no-write
"""

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

import eqx_remat as er
from benchmarks import _format, _results


def provenance(data: dict) -> str:
    m = data["meta"]
    # TPU targets ("v5e:16x16, 2xv5p:4x4x4", "v5e (each config's slice)"):
    # compiled ahead of time
    words = str(m.get("target") or "").replace(",", " ").split()
    aot = any(er.internal.slice_generation(w) for w in words)
    target = f", compiled for TPU {m['target']}, not run" if aot else ""
    return (
        f"`{m['command']}` — {m['device']}{target}, {m['cpu_count']}-core host, "
        f"jax {m['versions']['jax']}, {m['date']}"
    )


def section(script: str) -> Callable[[dict], str]:
    """The markdown of a results file that `benchmarks/<script>.py` wrote: its
    `report(data)`, from the same row type and column spec as its console
    tables. The script is loaded by name (`importlib`), the one place a script
    reads another: adding an experiment is one file and one entry below."""

    def report(data: dict) -> str:
        return importlib.import_module(f"benchmarks.{script}").report(data)

    report.__name__ = f"{script}.report"
    return report


# Each section: its title, the results file's stem, the script that wrote it.
SECTIONS = (
    ("CPU sweep", "sweep-cpu", section("run")),
    ("v5e sweep", "sweep-v5e", section("run")),
    ("GPU sweep, NVIDIA H100", "sweep-cuda", section("run")),
    ("Seed claim", "seed_claim", section("seed_claim")),
    ("Depth scaling", "depth_scaling", section("depth_scaling")),
    ("Compile time", "compile_time", section("compile_time")),
    ("Planner sweep, CPU", "plan_sweep-cpu", section("plan_sweep")),
    ("Planner sweep, CPU: two stacks", "plan_sweep-stacks-cpu", section("plan_sweep")),
    (
        "Planner sweep, v5e: the seed setting",
        "plan_sweep-v5e_2x4",
        section("plan_sweep"),
    ),
    (
        "Planner: MaxText's 16B model on v5e:16x16",
        "plan_sweep-v5e_16x16",
        section("plan_sweep"),
    ),
    ("Planner sweep, NVIDIA H100", "plan_sweep-cuda", section("plan_sweep")),
    (
        "The roofline against MaxText's v5e runs",
        "maxtext_mfu",
        section("maxtext_mfu"),
    ),
    ("Batch planner sweep, CPU", "batch_sweep-cpu", section("batch_sweep")),
    (
        "Batch planner, v5e: the seed setting",
        "batch_sweep-v5e_2x4",
        section("batch_sweep"),
    ),
    ("Meshes, CPU: 8 host devices", "mesh_sweep", section("mesh_sweep")),
    ("Meshes, v5e: the seed setting", "mesh_sweep_v5e_2x4", section("mesh_sweep")),
    (
        "Meshes, v5e: MaxText's 16B, 32B and 64B",
        "mesh_sweep_v5e_16x16",
        section("mesh_sweep"),
    ),
    (
        "Meshes, two v5e slices: MaxText's 16B",
        "mesh_sweep_2xv5e_16x16",
        section("mesh_sweep"),
    ),
)


def _measured(ts: list[dict]) -> str:
    """The figure each verdict was made on: one preset's, or the range."""
    values = [t["value"] for t in ts if t.get("value") is not None]
    if len(values) < len(ts) or not values:
        return "; ".join(t["measured"] for t in ts)
    where = ts[0].get("preset", "") if len(ts) == 1 else f"{len(ts)} presets"
    span = f"{min(values):.3f}x"
    if len(values) > 1:
        span += f" – {max(values):.3f}x"
    return f"{span} ({where})" if where else span


def summary(results: Path) -> str:
    """Every target of every results file, one row per target and file (its
    presets' verdicts counted), with where it was measured."""
    rows, notes = [], []
    for path in sorted(results.glob("*.json")):
        data = _results.read(path)
        if not data.get("targets"):
            continue
        mark = f"[{len(notes) + 1}]"
        notes.append(f"{mark} {provenance(data)}")
        groups: dict[str, list[dict]] = {}
        for t in data["targets"]:
            groups.setdefault(t.get("target", t["name"]), []).append(t)
        for name, ts in groups.items():
            met = [t["met"] for t in ts if t["met"] is not None]
            verdict = "n/a" if not met else f"{sum(met)} of {len(met)}"
            rows.append([name, _measured(ts), verdict, mark])
    cols = ["target", "measured", "met", "where"]
    return _format.markdown_table(cols, rows) + "\n\n" + "  \n".join(notes) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--results",
        type=Path,
        default=_results.RESULTS,
        help="the directory of results files (default: benchmarks/results)",
    )
    p.add_argument(
        "--no-write",
        action="store_true",
        help="only print; do not write summary.md (default: off)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    if not args.results.is_dir():
        p.error(f"--results {args.results}: no such directory.")
    if not any(args.results.glob("*.json")):
        p.error(f"--results {args.results}: no results files (*.json) in it.")
    for title, name, fn in SECTIONS:
        path = args.results / f"{name}.json"
        data = _results.read(path) if path.exists() else {}
        if data and "meta" not in data:  # rows written as they come, not finished
            partial = "partial (an interrupted run's rows): rerun its command"
            print(f"skipped {path}: {partial} to finish it.", file=sys.stderr)
        elif data:
            print(f"### {title}\n\n{provenance(data)}\n\n{fn(data)}\n")
    text = summary(args.results)
    print(f"### Summary\n\n{text}")
    if not args.no_write:
        (args.results / "summary.md").write_text(text)


if __name__ == "__main__":
    main()
