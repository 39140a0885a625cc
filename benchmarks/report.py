"""Markdown tables from results files, for `benchmarks/README.md`, and the
summary `summary.md` (every target verdict, which the top-level README quotes).
Nothing is measured or judged here: every number and verdict is read from the
JSON files the other scripts wrote.

    python benchmarks/report.py                          # benchmarks/results/
    python benchmarks/report.py --results DIR --no-write
"""

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import _common
from benchmarks._common import fmt_bytes, fmt_ms, fmt_pct, fmt_ratio, of_kind


MARK = {True: "met", False: "**not met**", None: "n/a"}
Column = tuple[str, Callable[[dict], Any]]


def table(columns: Sequence[Column], rows: Sequence[dict]) -> str:
    """A markdown table: one row per `rows` item, a cell per `(name, cell)`."""
    cells = [[cell(r) for _, cell in columns] for r in rows]
    return _common.markdown_table([name for name, _ in columns], cells)


def code(key: str) -> Callable[[dict], str]:
    return lambda r: f"`{r[key]}`"


def get(key: str, fmt: Callable[[Any], str] = str) -> Callable[[dict], str]:
    return lambda r: fmt(r.get(key))


def fits(r: dict) -> str:
    return "yes" if r.get("fits", True) else "no"


def provenance(data: dict) -> str:
    m = data["meta"]
    aot = str(m.get("target") or "").startswith("v5e")
    target = f", compiled for TPU {m['target']}, not run" if aot else ""
    return (
        f"`{m['command']}` — {m['device']}{target}, {m['cpu_count']}-core host, "
        f"jax {m['versions']['jax']}, {m['date']}"
    )


def _presets(data: dict, topology: bool = False) -> str:
    return "\n".join(
        f"- `{n}`: {p['describe']}" + (f", {p['topology']}" if topology else "")
        for n, p in data["presets"].items()
    )


def targets(data: dict) -> str:
    cols = [("", lambda t: MARK[t["met"]]), ("target", get("name"))]
    cols.append(("measured", get("measured")))
    return table(cols, data["targets"]) if data.get("targets") else ""


SWEEP = [
    ("preset", get("group")),
    ("impl", get("impl")),
    ("checkpoint", code("checkpoint")),
    ("temp", get("temp_bytes", fmt_bytes)),
    ("vs None", get("temp_ratio", fmt_ratio)),
    ("FLOPs vs None", get("flops_ratio", fmt_ratio)),
    ("time vs None", get("time_ratio", fmt_ratio)),
    ("peak (measured)", get("peak_bytes", fmt_bytes)),
    ("MFU", get("mfu", fmt_pct)),
    ("fits", fits),
]


def _losses(p: dict) -> str:
    if "losses_equal" not in p:
        return "n/a"
    return f"{'yes' if p['losses_equal'] else 'NO'} (Δ {p['loss_abs_diff']:.0e})"


PEERS = [
    ("preset", get("group")),
    ("ours", code("ours")),
    ("peer", get("peer")),
    ("temp ours/peer", get("temp_ratio", fmt_ratio)),
    ("time ours/peer", get("time_ratio", fmt_ratio)),
    ("losses equal", _losses),
]


def sweep_section(data: dict) -> str:
    peers = table(PEERS, data["peers"]) if data.get("peers") else ""
    sweep = _presets(data) + "\n\n" + table(SWEEP, data["rows"])
    return "\n\n".join([sweep, peers, targets(data)])


SEED = [
    ("config", get("group")),
    ("checkpoint", code("checkpoint")),
    ("temp / chip", get("temp_bytes", fmt_bytes)),
    ("temp+args+out / chip", get("total_bytes", fmt_bytes)),
    ("fits", fits),
    ("temp vs None", get("temp_ratio", fmt_ratio)),
    ("FLOPs vs None", get("flops_ratio", fmt_ratio)),
    ("peak (measured)", get("peak_bytes", fmt_bytes)),
    ("step vs None", get("time_ratio", fmt_ratio)),
]


def seed(data: dict) -> str:
    seed = table(SEED, data["rows"])
    return _presets(data, topology=True) + "\n\n" + seed + "\n\n" + targets(data)


def _by_depth(label: str, depths: list, cell: Callable, *extra: Column) -> list:
    """Columns of a checkpoints × depths table: `cell(spec, depth)` per depth."""
    return [
        ("checkpoint", lambda s: f"`{s}`"),
        *((label.format(d), lambda s, d=d: cell(s, d)) for d in depths),
        *extra,
    ]


def depth(data: dict) -> str:
    depths = sorted({r["depth"] for r in data["rows"]})
    by = {(r["spec"], r["depth"]): r for r in data["rows"]}
    specs = list(dict.fromkeys(r["spec"] for r in data["rows"]))
    slopes = data["memory_slopes"]["slopes"]
    slope = ("slope", lambda s: fmt_ratio(slopes[s]).rstrip("x"))
    mem = _by_depth(
        "D={}", depths, lambda s, d: fmt_bytes(by[(s, d)]["temp_bytes"]), slope
    )
    comp = _by_depth("D={}", depths, lambda s, d: f"{by[(s, d)]['compile_s']:.1f}")
    return (
        f"{data['meta']['describe']}. Compiled temp memory, and the log-log slope "
        f"from D = {data['memory_slopes']['from_depth']}:\n\n"
        + table(mem, specs)
        + "\n\nTrace + lower + compile, seconds (median):\n\n"
        + table(comp, specs)
    )


def compile_time(data: dict) -> str:
    layers = sorted({r["layers"] for r in data["rows"]})
    med = {(r["checkpoint"], r["layers"]): r["compile_s"] for r in data["rows"]}
    ratios = data["ratio_deepest_to_shallowest"]
    ratio = (f"{layers[-1]} / {layers[0]}", lambda s: fmt_ratio(ratios[s]))
    cols = _by_depth("{} layers (s)", layers, lambda s, n: f"{med[(s, n)]:.2f}", ratio)
    return (
        f"{data['meta']['describe']}\n\n{table(cols, list(ratios))}\n\n{targets(data)}"
    )


def _planning(data: dict, r: dict) -> str:
    p = data["presets"][r["group"]]
    return (
        f"- `{r['group']}`: {p['describe']}, {p['topology']}. Planning "
        f"{r['budgets']} budgets: {r['compiles']} compiles, {r['seconds']:.0f} s, "
        f"{r.get('cpu_seconds', 0):.0f} s of CPU (load average "
        f"{r['load_average']:.1f} on a {data['meta']['cpu_count']}-core host)"
    )


def plan_sweep(data: dict) -> str:
    """The planning cost, each budget's pick beside the best uniform candidate
    that fits, the clock's figures, then the targets."""
    cols = ["preset", "budget", "pick", "compiled", "predicted", "est. time"]
    cols += ["best uniform that fits", "its est. time"]
    picks = [_common.pick_cells(r, "`{}`") for r in of_kind(data["rows"], "pick")]
    parts = ["\n".join(_planning(data, r) for r in of_kind(data["rows"], "planning"))]
    parts.append(_common.markdown_table(cols, picks))
    if of_kind(data["rows"], "timed"):
        parts.append(_clock(data))
    return "\n\n".join(parts + [targets(data)])


CLOCK = [
    ("preset", get("group")),
    ("budget", get("budget_bytes", fmt_bytes)),
    ("pick", code("checkpoint")),
    ("measured", get("measured_s", fmt_ms)),
    ("fastest fitting uniform", code("best_uniform_measured")),
    ("measured", get("best_uniform_measured_s", fmt_ms)),
    ("pick / it", lambda r: f"{r['clock_ratio']:.3f}x"),
]


def _clock(data: dict) -> str:
    """Each pick's measured time beside the fastest fitting uniform
    checkpoint's, then every checkpoint timed afresh, then the few rounds."""
    picks = [
        r for r in of_kind(data["rows"], "pick") if r.get("best_uniform_measured_s")
    ]
    timed = sorted(
        of_kind(data["rows"], "timed"), key=lambda r: (r["group"], r["memory_bytes"])
    )
    points = [_common.timed_cells(r, "`{}`", " (est.)") for r in timed]
    return (
        "By the clock (every pick and uniform checkpoint timed afresh, "
        "round-robin):\n\n"
        + table(CLOCK, picks)
        + "\n\n"
        + _common.markdown_table(_common.TIMED_COLUMNS, points)
        + few_rounds(of_kind(data["rows"], "rounds"))
    )


def few_rounds(found: list[dict]) -> str:
    """How well a few rounds rank the checkpoints: the planner's statistic (the
    faster half of rounds) beside the paired ratio."""
    if not found:
        return ""
    rows = [
        [r["group"], str(k), f"{ours:.2f}", f"{before:.2f}"]
        for r in found
        for k, ours, before in zip(r["k"], r["faster_half"], r["paired"])
    ]
    cols = ["preset", "k rounds", "faster half (the planner's)", "paired ratio"]
    return (
        f"\n\nFew rounds: every window of k consecutive rounds of the "
        f"{found[0]['rounds']} above ranks the timed checkpoints by each "
        "statistic; the mean rank correlation with the other rounds' "
        "medians:\n\n" + _common.markdown_table(cols, rows)
    )


def _plan_time(r: dict) -> str:
    alone = f" ({r['plain_plan_s']:.0f} s alone)" if r.get("plain_plan_s") else ""
    return f"{r['plan_s']:.0f} s{alone}"


BATCH = [
    ("preset", get("group")),
    ("budget", get("budget_bytes", fmt_bytes)),
    ("pick", code("checkpoint")),
    ("micro-batches", get("micro_batches")),
    ("loss chunk", lambda r: r["loss_chunk_size"] or "whole"),
    ("compiled", get("memory_bytes", fmt_bytes)),
    ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
    ("vs fastest fitting", lambda r: f"{r['ratio']:.3f}x"),
    ("which", code("best_combination")),
    ("planned in", _plan_time),
]


def batch_sweep(data: dict) -> str:
    """Per budget: the planner's pick, its tokens/s, its time against the
    fastest fitting combination's; then the targets."""
    rows = table(BATCH, of_kind(data["rows"], "pick"))
    return "\n\n".join([_presets(data), rows, targets(data)])


BATCH_AOT = [
    ("preset", get("group")),
    ("what", lambda r: "plan" if r["kind"] == "aot-pick" else "MaxText's recipe"),
    ("checkpoint", code("checkpoint")),
    ("per-chip batch", get("per_chip_batch")),
    ("micro-batches", lambda r: r.get("micro_batches", 1)),
    ("loss chunk", lambda r: r.get("loss_chunk_size") or "whole"),
    ("compiled", get("memory_bytes", fmt_bytes)),
    ("tokens/s per chip (roofline)", lambda r: f"{r['tokens_per_s_per_chip']:,.0f}"),
]


def batch_aot(data: dict) -> str:
    """The plan's pick for the global batch beside MaxText's recipe at each
    per-chip batch that fits, in tokens/s per chip by the roofline."""
    return _presets(data) + "\n\n" + table(BATCH_AOT, data["rows"])


SECTIONS = (
    ("CPU sweep", "sweep-cpu", sweep_section),
    ("v5e sweep", "sweep-v5e", sweep_section),
    ("GPU sweep, NVIDIA H100", "sweep-cuda", sweep_section),
    ("Seed claim", "seed_claim", seed),
    ("Depth scaling", "depth_scaling", depth),
    ("Compile time", "compile_time", compile_time),
    ("Planner sweep, CPU", "plan_sweep-cpu", plan_sweep),
    ("Planner sweep, v5e: the seed setting", "plan_sweep-v5e_2x4", plan_sweep),
    ("Planner: MaxText's 16B model on v5e:16x16", "plan_sweep-v5e_16x16", plan_sweep),
    ("Planner sweep, NVIDIA H100", "plan_sweep-cuda", plan_sweep),
    ("Batch planner sweep, CPU", "batch_sweep-cpu", batch_sweep),
    ("Batch planner, v5e: the seed setting", "batch_sweep-v5e_2x4", batch_aot),
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
        data = json.loads(path.read_text())
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
    return _common.markdown_table(cols, rows) + "\n\n" + "  \n".join(notes) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--results",
        type=Path,
        default=_common.RESULTS,
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
        data = json.loads(path.read_text()) if path.exists() else {}
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
