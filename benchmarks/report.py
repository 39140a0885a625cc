"""Markdown tables from results files, for `benchmarks/README.md`, and the
summary `summary.md` (every target verdict, which the top-level README quotes).

    python benchmarks/report.py                          # benchmarks/results/
    python benchmarks/report.py --results DIR --no-write

Nothing is measured or judged here: every number and every verdict is read from
the JSON files the other scripts wrote (`sweep-*.json`, `seed_claim.json`,
`depth_scaling.json`, `compile_time.json`, `plan-*.json`,
`plan_sweep-*.json`, `batch_sweep-*.json`).
"""

import argparse
import json
from pathlib import Path

from benchmarks import _common, _targets


def provenance(data: dict) -> str:
    m = data["meta"]
    aot = str(m.get("target") or "").startswith("v5e")
    target = f", compiled for TPU {m['target']}, not run" if aot else ""
    return (
        f"`{m['command']}` — {m['device']}{target}, {m['cpu_count']}-core host, "
        f"jax {m['versions']['jax']}, {m['date']}"
    )


def sweep(data: dict) -> str:
    cols = ["preset", "impl", "checkpoint", "temp", "vs None", "FLOPs vs None"]
    cols += ["time vs None", "peak (measured)", "MFU", "fits"]
    rows = [
        [
            r["group"],
            r["impl"],
            f"`{r['checkpoint']}`",
            _common.fmt_bytes(r.get("temp_bytes")),
            _common.fmt_ratio(r.get("temp_ratio")),
            _common.fmt_ratio(r.get("flops_ratio")),
            _common.fmt_ratio(r.get("time_ratio")),
            _common.fmt_bytes(r.get("peak_bytes")),
            _common.fmt_pct(r.get("mfu")),
            "yes" if r.get("fits", True) else "no",
        ]
        for r in data["rows"]
    ]
    return _presets(data) + "\n\n" + _common.markdown_table(cols, rows)


def _presets(data: dict, topology: bool = False) -> str:
    return "\n".join(
        f"- `{n}`: {p['describe']}" + (f", {p['topology']}" if topology else "")
        for n, p in data["presets"].items()
    )


def peers(data: dict) -> str:
    rows = [
        [
            p["group"],
            f"`{p['ours']}`",
            p["peer"],
            _common.fmt_ratio(p["temp_ratio"]),
            _common.fmt_ratio(p["time_ratio"]),
            "n/a"
            if "losses_equal" not in p
            else f"{'yes' if p['losses_equal'] else 'NO'} (Δ {p['loss_abs_diff']:.0e})",
        ]
        for p in data.get("peers", [])
    ]
    cols = ["preset", "ours", "peer", "temp ours/peer", "time ours/peer"]
    cols += ["losses equal"]
    return _common.markdown_table(cols, rows) if rows else ""


MARK = {True: "met", False: "**not met**", None: "n/a"}


def targets(data: dict) -> str:
    rows = [[MARK[t["met"]], t["name"], t["measured"]] for t in data.get("targets", [])]
    return _common.markdown_table(["", "target", "measured"], rows) if rows else ""


def seed(data: dict) -> str:
    cols = ["config", "checkpoint", "temp / chip", "temp+args+out / chip", "fits"]
    cols += ["temp vs None", "FLOPs vs None", "peak (measured)", "step vs None"]
    rows = [
        [
            r["group"],
            f"`{r['checkpoint']}`",
            _common.fmt_bytes(r.get("temp_bytes")),
            _common.fmt_bytes(r.get("total_bytes")),
            "yes" if r["fits"] else "no",
            _common.fmt_ratio(r.get("temp_ratio")),
            _common.fmt_ratio(r.get("flops_ratio")),
            _common.fmt_bytes(r.get("peak_bytes")),
            _common.fmt_ratio(r.get("time_ratio")),
        ]
        for r in data["rows"]
    ]
    table = _common.markdown_table(cols, rows)
    return _presets(data, topology=True) + "\n\n" + table + "\n\n" + targets(data)


def _by_depth(specs, depths, cell, *extra) -> list[list[str]]:
    """A table of checkpoints (rows) against depths (columns): `cell(s, d)`,
    then the columns `extra(s)`."""
    return [
        [f"`{s}`", *(cell(s, d) for d in depths), *(f(s) for f in extra)] for s in specs
    ]


def depth(data: dict) -> str:
    depths = sorted({r["depth"] for r in data["rows"]})
    by = {(r["spec"], r["depth"]): r for r in data["rows"]}
    specs = list(dict.fromkeys(r["spec"] for r in data["rows"]))
    slopes = data["memory_slopes"]["slopes"]
    cols = ["checkpoint", *(f"D={d}" for d in depths)]
    mem = _by_depth(
        specs,
        depths,
        lambda s, d: _common.fmt_bytes(by[(s, d)]["temp_bytes"]),
        lambda s: _common.fmt_ratio(slopes[s]).rstrip("x"),
    )
    comp = _by_depth(specs, depths, lambda s, d: f"{by[(s, d)]['compile_s']:.1f}")
    return (
        f"{data['meta']['describe']}. Compiled temp memory, and the log-log slope "
        f"from D = {data['memory_slopes']['from_depth']}:\n\n"
        + _common.markdown_table([*cols, "slope"], mem)
        + "\n\nTrace + lower + compile, seconds (median):\n\n"
        + _common.markdown_table(cols, comp)
    )


def compile_time(data: dict) -> str:
    layers = sorted({r["layers"] for r in data["rows"]})
    med = {(r["checkpoint"], r["layers"]): r["compile_s"] for r in data["rows"]}
    ratios = data["ratio_deepest_to_shallowest"]
    rows = _by_depth(
        ratios,
        layers,
        lambda s, n: f"{med[(s, n)]:.2f}",
        lambda s: _common.fmt_ratio(ratios[s]),
    )
    cols = ["checkpoint", *(f"{n} layers (s)" for n in layers)]
    cols += [f"{layers[-1]} / {layers[0]}"]
    table = _common.markdown_table(cols, rows)
    return f"{data['meta']['describe']}\n\n{table}\n\n{targets(data)}"


def plan_rows(rows: list[dict], arrow: str, code: str) -> list[list[str]]:
    """`run.py --budget`'s table, markdown or console: `arrow` marks the pick,
    `code` formats a checkpoint."""
    return [
        [
            r["group"],
            arrow if r.get("chosen") else "",
            code.format(r["checkpoint"]),
            _common.fmt_bytes(r.get("memory_bytes")),
            _common.fmt_flops(r.get("flops")),
            "yes" if r["fits"] else "no",
        ]
        for r in rows
    ]


def plan(data: dict) -> str:
    cols = ["preset", "", "checkpoint", "temp+args+out / chip", "FLOPs", "fits"]
    return _common.markdown_table(cols, plan_rows(data["rows"], "**→**", "`{}`"))


def plan_sweep(data: dict) -> str:
    """The planner's sweep: the planning cost, then each budget's pick beside
    the best uniform candidate that fits, then the targets."""
    rows = data["rows"]
    out = []
    for r in rows:
        if r["kind"] == "planning":
            out.append(
                f"- `{r['group']}`: {data['presets'][r['group']]['describe']}, "
                f"{data['presets'][r['group']]['topology']}. Planning "
                f"{r['budgets']} budgets: {r['compiles']} compiles, "
                f"{r['seconds']:.0f} s, {r.get('cpu_seconds', 0):.0f} s of CPU "
                f"(load average {r['load_average']:.1f} "
                f"on a {data['meta']['cpu_count']}-core host)"
            )
    cols = ["preset", "budget", "pick", "compiled", "predicted", "est. time"]
    cols += ["best uniform that fits", "its est. time"]
    table = [_common.pick_cells(r, "`{}`") for r in rows if r["kind"] == "pick"]
    parts = ["\n".join(out), _common.markdown_table(cols, table)]
    timed = [r for r in rows if r["kind"] == "timed"]
    if timed:
        parts.append(_clock(rows, timed))
    return "\n\n".join(parts + [targets(data)])


def _clock(rows: list[dict], timed: list[dict]) -> str:
    """By the clock: each pick's measured time beside the fastest fitting
    uniform checkpoint's, then every checkpoint timed afresh."""
    picks = [
        [
            r["group"],
            _common.fmt_bytes(r["budget_bytes"]),
            f"`{r['checkpoint']}`",
            _common.fmt_ms(r["measured_s"]),
            f"`{r['best_uniform_measured']}`",
            _common.fmt_ms(r["best_uniform_measured_s"]),
            f"{_targets.clock_ratio(r):.3f}x",
        ]
        for r in rows
        if r["kind"] == "pick" and r.get("best_uniform_measured_s")
    ]
    points = [
        _common.timed_cells(r, "`{}`", " (est.)")
        for r in sorted(timed, key=lambda r: (r["group"], r["memory_bytes"]))
    ]
    cols = ["preset", "budget", "pick", "measured", "fastest fitting uniform"]
    cols += ["measured", "pick / it"]
    return (
        "By the clock (every pick and uniform checkpoint timed afresh, "
        "round-robin):\n\n"
        + _common.markdown_table(cols, picks)
        + "\n\n"
        + _common.markdown_table(_common.TIMED_COLUMNS, points)
        + few_rounds(rows)
    )


def few_rounds(rows: list[dict]) -> str:
    """How well a few of those rounds rank the checkpoints: the planner's
    statistic (the faster half of rounds) beside the paired ratio."""
    found = [r for r in rows if r["kind"] == "rounds"]
    if not found:
        return ""
    table = [
        [r["group"], str(k), f"{ours:.2f}", f"{before:.2f}"]
        for r in found
        for k, ours, before in zip(r["k"], r["faster_half"], r["paired"])
    ]
    cols = ["preset", "k rounds", "faster half (the planner's)", "paired ratio"]
    return (
        f"\n\nFew rounds: every window of k consecutive rounds of the "
        f"{found[0]['rounds']} above ranks the timed checkpoints by each "
        "statistic; the mean rank correlation with the other rounds' "
        "medians:\n\n" + _common.markdown_table(cols, table)
    )


def sweep_section(data: dict) -> str:
    return "\n\n".join([sweep(data), peers(data), targets(data)])


def batch_sweep(data: dict) -> str:
    """Per budget: the planner's (micro-batches, loss chunk, checkpoint), its
    tokens/s, its time against the fastest fitting combination's; then the
    targets."""
    cols = ["preset", "budget", "pick", "micro-batches", "loss chunk", "compiled"]
    cols += ["tokens/s", "vs fastest fitting", "which", "planned in"]
    rows = [
        [
            r["group"],
            _common.fmt_bytes(r["budget_bytes"]),
            f"`{r['checkpoint']}`",
            r["micro_batches"],
            r["loss_chunk_size"] or "whole",
            _common.fmt_bytes(r["memory_bytes"]),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['ratio']:.3f}x",
            f"`{r['best_combination']}`",
            f"{r['plan_s']:.0f} s"
            + (f" ({r['plain_plan_s']:.0f} s alone)" if r.get("plain_plan_s") else ""),
        ]
        for r in data["rows"]
        if r["kind"] == "pick"
    ]
    return "\n\n".join(
        [_presets(data), _common.markdown_table(cols, rows), targets(data)]
    )


def batch_aot(data: dict) -> str:
    """The plan's pick for the global batch beside MaxText's recipe at each
    per-chip batch that fits, in tokens/s per chip by the roofline."""
    cols = ["preset", "what", "checkpoint", "per-chip batch", "micro-batches"]
    cols += ["loss chunk", "compiled", "tokens/s per chip (roofline)"]
    rows = [
        [
            r["group"],
            "plan" if r["kind"] == "aot-pick" else "MaxText's recipe",
            f"`{r['checkpoint']}`",
            r["per_chip_batch"],
            r.get("micro_batches", 1),
            r.get("loss_chunk_size") or "whole",
            _common.fmt_bytes(r["memory_bytes"]),
            f"{r['tokens_per_s_per_chip']:,.0f}",
        ]
        for r in data["rows"]
    ]
    return _presets(data) + "\n\n" + _common.markdown_table(cols, rows)


SECTIONS = (
    ("CPU sweep", "sweep-cpu", sweep_section),
    ("v5e sweep", "sweep-v5e", sweep_section),
    ("GPU sweep, NVIDIA H100", "sweep-cuda", sweep_section),
    ("Seed claim", "seed_claim", seed),
    ("Depth scaling", "depth_scaling", depth),
    ("Compile time", "compile_time", compile_time),
    ("Planner", "plan-v5e", plan),
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
    span = (
        f"{min(values):.3f}x"
        if len(values) == 1
        else (f"{min(values):.3f}x – {max(values):.3f}x")
    )
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
    return (
        _common.markdown_table(["target", "measured", "met", "where"], rows)
        + "\n\n"
        + "  \n".join(notes)
        + "\n"
    )


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
    for title, name, fn in SECTIONS:
        path = args.results / f"{name}.json"
        if path.exists():
            data = json.loads(path.read_text())
            print(f"### {title}\n\n{provenance(data)}\n\n{fn(data)}\n")
    text = summary(args.results)
    print(f"### Summary\n\n{text}")
    if not args.no_write:
        (args.results / "summary.md").write_text(text)


if __name__ == "__main__":
    main()
