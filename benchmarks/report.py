"""Markdown tables from the results files, for `benchmarks/README.md` and the short
summary `results/summary.md` (which the top-level README quotes).

    python benchmarks/report.py              # print every table, write summary.md
    python benchmarks/report.py --results DIR --no-write

Reads whichever of `sweep-cpu.json`, `sweep-v5e.json`, `seed_claim.json`,
`depth_scaling.json`, `compile_time.json` and `plan-v5e.json` exist; nothing is
measured here.
"""

import argparse
import json
import os
import sys
from pathlib import Path


os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402


def load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def machine(meta: dict) -> str:
    cmd = meta["command"]
    if (
        meta.get("target", "").startswith("v5e")
        or "--target v5e" in cmd
        or ("seed_claim" in cmd)
    ):
        return (
            f"TPU v5e via AOT (libtpu {meta['versions']['libtpu']}), compiled on "
            f"a {meta['cpu_count']}-core CPU container"
        )
    return f"{meta['cpu_count']}-core CPU container ({meta['device']}, shared)"


def provenance(data: dict) -> str:
    m = data["meta"]
    return f"`{m['command']}` — {machine(m)}, jax {m['versions']['jax']}, {m['date']}"


def sweep(data: dict) -> str:
    timed = any(r.get("time_ratio") is not None for r in data["rows"])
    cols = ["preset", "impl", "checkpoint", "temp", "vs None", "FLOPs vs None"]
    cols += ["time vs None"] if timed else ["host temp"]
    cols += ["Pareto"]
    rows = []
    for r in data["rows"]:
        cells = [
            r["group"],
            r["impl"],
            f"`{r['checkpoint']}`",
            C.fmt_bytes(r["temp_bytes"]),
            C.fmt_ratio(r.get("temp_ratio")),
            C.fmt_ratio(r.get("flops_ratio")),
        ]
        cells.append(
            C.fmt_ratio(r.get("time_ratio"))
            if timed
            else C.fmt_bytes(r.get("host_temp_bytes") or None)
        )
        cells.append("*" if r.get("pareto") else "")
        rows.append(cells)
    presets = "\n".join(f"- `{n}`: {p['describe']}" for n, p in data["presets"].items())
    return presets + "\n\n" + C.markdown_table(cols, rows)


def peers(data: dict) -> str:
    cols = [
        "preset",
        "ours",
        "peer",
        "temp ours/peer",
        "time ours/peer",
        "losses equal",
    ]
    rows = [
        [
            p["group"],
            f"`{p['ours']}`",
            p["peer"],
            C.fmt_ratio(p["temp_ratio"]),
            C.fmt_ratio(p["time_ratio"]),
            "-"
            if "losses_equal" not in p
            else f"{'yes' if p['losses_equal'] else 'NO'} (Δ {p['loss_abs_diff']:.0e})",
        ]
        for p in data["peers"]
    ]
    return C.markdown_table(cols, rows)


def targets(data: dict) -> str:
    mark = {True: "met", False: "**not met**", None: "n/a"}
    rows = [[mark[t["met"]], t["name"], t["measured"]] for t in data["targets"]]
    return C.markdown_table(["", "target", "measured"], rows)


def seed(data: dict) -> str:
    cols = ["config", "checkpoint", "temp / chip", "temp+args+out / chip"]
    cols += ["fits 16 GiB", "temp vs None", "FLOPs vs None", "host temp"]
    rows = []
    for r in data["rows"]:
        red = r.get("temp_reduction_vs_None")
        fl = r.get("flops_overhead_vs_None")
        rows.append(
            [
                r["config"],
                f"`{r['checkpoint']}`",
                C.fmt_bytes(r["temp_bytes"]) + ("" if r["compiled"] else " †"),
                C.fmt_bytes(r["total_bytes"]) if r["compiled"] else "-",
                "yes" if r["fits_16GiB"] else "no",
                "-"
                if red is None or r["checkpoint"] == "None"
                else f"−{100 * red:.0f}%",
                "-" if fl is None or r["checkpoint"] == "None" else f"+{100 * fl:.1f}%",
                C.fmt_bytes(r["host_temp_bytes"]) if r.get("host_temp_bytes") else "-",
            ]
        )
    configs = {}
    for r in data["rows"]:
        configs.setdefault(r["config"], r)
    legend = "\n".join(
        f"- `{n}`: d_model {r['d_model']}, {r['layers']} layers, seq {r['seq']}, "
        f"batch {r['batch']}, {r['topology']}, "
        f"{'FSDP' if r['fsdp'] else 'replicated'} parameters, "
        f"{r['param_count'] / 1e9:.2f}B parameters"
        for n, r in configs.items()
    )
    return legend + "\n\n" + C.markdown_table(cols, rows)


def depth(data: dict) -> str:
    rows_ = data["rows"]
    depths = sorted({r["depth"] for r in rows_})
    specs = list(dict.fromkeys(r["schedule"] for r in rows_))
    by = {(r["schedule"], r["depth"]): r for r in rows_}
    slopes = data["memory_slopes"]["slopes"]
    lo = data["memory_slopes"]["from_depth"]
    cols = ["schedule"] + [f"D={d}" for d in depths] + [f"slope (D ≥ {lo})"]
    mem = [
        [f"`{s}`"]
        + [C.fmt_bytes(by[(s, d)]["temp_bytes"]) for d in depths]
        + ["-" if slopes[s] is None else f"{slopes[s]:.2f}"]
        for s in specs
    ]
    fl = []
    for s in specs:
        cells = [f"`{s}`"]
        for d in depths:
            f, b = by[(s, d)]["flops"], by[("None", d)]["flops"]
            cells.append("-" if f is None else f"{f / b:.2f}x")
        fl.append(cells)
    ct = [
        [f"`{s}`"] + [f"{by[(s, d)]['compile_s']:.1f}" for d in depths] for s in specs
    ]
    return (
        "Compiled temp memory:\n\n"
        + C.markdown_table(cols, mem)
        + "\n\nFLOPs / FLOPs of `None`:\n\n"
        + C.markdown_table(cols[:-1], fl)
        + "\n\nTrace + lower + compile, seconds (median):\n\n"
        + C.markdown_table(cols[:-1], ct)
    )


def compile_time(data: dict) -> str:
    layers = sorted({r["layers"] for r in data["rows"]})
    med = {(r["checkpoint"], r["layers"]): r["median_s"] for r in data["rows"]}
    specs = list(dict.fromkeys(r["checkpoint"] for r in data["rows"]))
    cols = ["checkpoint"] + [f"{n} layers (s)" for n in layers]
    cols += [f"{layers[-1]} / {layers[0]}"]
    rows = [
        [f"`{s}`"]
        + [f"{med[(s, n)]:.2f}" for n in layers]
        + [f"{data['ratio_deepest_to_shallowest'][s]:.2f}x"]
        for s in specs
    ]
    return data["meta"]["describe"] + "\n\n" + C.markdown_table(cols, rows)


def plan(data: dict) -> str:
    out = []
    for p in data["plans"]:
        if "error" in p:
            out.append(f"{p['preset']}: {p['error']}")
            continue
        rows = [
            [
                "**→**" if e["checkpoint"] == p["chosen"] else "",
                f"`{e['checkpoint']}`",
                C.fmt_bytes(e["memory_bytes"]),
                C.fmt_flops(e["flops"]),
                "yes" if e["fits"] else "no",
            ]
            for e in p["table"]
        ]
        out.append(
            f"{p['describe']}, budget {C.fmt_bytes(p['budget_bytes'])} per chip "
            f"[{p['target']}]: chooses `{p['chosen']}`\n\n"
            + C.markdown_table(
                ["", "checkpoint", "temp+args+out / chip", "FLOPs", "fits"], rows
            )
        )
    return "\n\n".join(out)


def _target(data, prefix):
    return next((t for t in data["targets"] if t["name"].startswith(prefix)), None)


def summary(results: Path) -> str:
    """The short table for the top-level README."""
    cpu = load(results, "sweep-cpu")
    v5e = load(results, "sweep-v5e")
    timing = load(results, "timing-transformer-cpu")
    sc = load(results, "seed_claim")
    dep = load(results, "depth_scaling")
    ct = load(results, "compile_time")
    sources = [
        (cpu, "CPU"),
        (v5e, "v5e AOT"),
        (timing, "CPU, 30 steps"),
        (sc, "v5e AOT"),
        (ct, "CPU"),
        (dep, "CPU"),
    ]
    marks = {}
    for data, _ in sources:
        if data is not None:
            marks[id(data)] = "¹²³⁴⁵⁶⁷"[len(marks)]
    rows = []

    def add(what, target, measured, ok, data, where):
        ok = {True: "yes", False: "**no**", None: "n/a"}[ok]
        rows.append([what, target, measured, ok, where + marks[id(data)]])

    def transformer(data):
        return next(n for n, p in data["presets"].items() if p["kind"] == "transformer")

    for data, where in ((cpu, "CPU"), (v5e, "v5e AOT")):
        if data is None:
            continue
        g = transformer(data)
        for spec, lim in (("dots", "≥ 40% less"), ("nothing", "≥ 70% less")):
            t = _target(data, f"{g}: '{spec}' temp")
            if t:
                what = f"Transformer `{spec}` temp vs `None`"
                add(what, lim, t["measured"], t["met"], data, where)
        t = _target(data, f"{g}: 'dots' FLOPs")
        if t:
            what = "Transformer `dots` FLOPs vs `None`"
            add(what, "≤ 1.10x", t["measured"], t["met"], data, where)
        for impl, lim in (("hand-written", 1.02), ("flax", 1.00)):
            ps = [
                p
                for p in data["peers"]
                if p["group"] == g and p["peer"].startswith(impl)
            ]
            if ps:
                mem = [p["temp_ratio"] for p in ps]
                add(
                    f"Transformer temp, ours / {impl} (each policy)",
                    f"≤ {lim:.2f}x",
                    f"{min(mem):.3f}x – {max(mem):.3f}x",
                    max(mem) <= lim,
                    data,
                    where,
                )
    for data, where in ((timing, "CPU, 30 steps"), (cpu, "CPU, 5 steps")):
        if data is None:
            continue
        g = transformer(data)
        for impl in ("hand-written", "flax"):
            tim = [
                p["time_ratio"]
                for p in data["peers"]
                if p["group"] == g and p["peer"].startswith(impl)
            ]
            if tim:
                add(
                    f"Transformer step time, ours / {impl} (each policy)",
                    "≤ 1.05x",
                    f"{min(tim):.2f}x – {max(tim):.2f}x",
                    max(tim) <= 1.05,
                    data,
                    where,
                )
    if sc:
        dots = [r for r in sc["rows"] if r["checkpoint"] == "dots"]
        reds = [r["temp_reduction_vs_None"] for r in dots]
        fits = [r["config"] for r in dots if r["fits_16GiB"]]
        add(
            f"Seed claim: `dots` temp vs `None`, {len(dots)} configs around d_model "
            "2048, 24 layers, seq 2048, batch 32, v5e-8, FSDP",
            "≥ 40% less",
            f"{100 * min(reds):.0f}% – {100 * max(reds):.0f}% less; fits 16 GiB: "
            f"{', '.join(fits) or 'none'}",
            min(reds) >= 0.40,
            sc,
            "v5e AOT",
        )
        fl = [r["flops_overhead_vs_None"] for r in dots]
        add(
            "Seed claim: `dots` FLOPs overhead",
            "≤ 10% (claim: ~12% time)",
            f"+{100 * max(fl):.1f}%",
            max(fl) <= 0.10,
            sc,
            "v5e AOT",
        )
    for data, where in ((cpu, "CPU"), (v5e, "v5e AOT")):
        if data is None:
            continue
        for p in data["peers"]:
            if "treeverse" not in p["peer"]:
                continue
            d = data["presets"][p["group"]]["depth"]
            lim = 0.85 if p["ours"] == "recursive()" else 1.00
            timed = p["time_ratio"] is not None
            measured = f"temp {p['temp_ratio']:.3f}x" + (
                f", time {p['time_ratio']:.2f}x" if timed else ""
            )
            add(
                f"{p['group']} (D={d}): `{p['ours']}` / `equinox.internal.scan` "
                f"{p['peer'].split()[-1]}",
                f"temp ≤ {lim:.2f}x" + (", time < 1x" if timed else ""),
                measured,
                p["temp_ratio"] <= lim and (not timed or p["time_ratio"] < 1),
                data,
                where,
            )
        for g in data["presets"]:
            ours = [
                r
                for r in data["rows"]
                if r["group"] == g
                and r["impl"] == "eqx_remat"
                and r["checkpoint"] not in ("None", "everything")
                and r["temp_ratio"] is not None
            ]
            if ours:
                worst = max(ours, key=lambda r: r["temp_ratio"])
                add(
                    f"{g}: under `jax.vmap`, every checkpoint ≤ `None` in temp",
                    "≤ 1x",
                    f"largest {worst['temp_ratio']:.2f}x (`{worst['checkpoint']}`)",
                    worst["temp_ratio"] <= 1.0,
                    data,
                    where,
                )
    if ct:
        t = ct["target"]
        pol, sch = t.get("policies", {}), t.get("schedules", {})
        if pol:
            add(
                "Compile time, 64- vs 4-layer transformer, `None` and policies",
                "≤ 1.5x",
                f"{min(pol.values()):.2f}x – {max(pol.values()):.2f}x",
                t["met"],
                ct,
                "CPU",
            )
        if sch:
            add(
                "… and under the schedules",
                "≤ 1.5x",
                ", ".join(f"`{k}` {v:.2f}x" for k, v in sch.items()),
                max(sch.values()) <= 1.5,
                ct,
                "CPU",
            )
    if dep:
        s = dep["memory_slopes"]["slopes"]
        add(
            "ResidualChain temp memory vs D = 64 … 4096: log-log slope",
            "1 / ½ / ⅓ / ~0 (O(log D))",
            ", ".join(
                f"`{k}` {s[k]:.2f}"
                for k in ("None", "every(sqrt)", "nested(3)", "recursive()")
                if s.get(k) is not None
            ),
            None,
            dep,
            "CPU",
        )
    notes = [
        f"{marks[id(d)]} {provenance(d)}"
        for d, _ in sources
        if d is not None and id(d) in marks
    ]
    return (
        C.markdown_table(["", "target", "measured", "met", "where"], rows)
        + "\n\n"
        + "\n".join(f"{n}  " for n in notes).rstrip()
        + "\n\nDetails, plots and the reasons behind each number: "
        "[benchmarks/README.md](benchmarks/README.md#results).\n"
    )


def _peer_range(data, impl, key="temp_ratio"):
    g = next(n for n, p in data["presets"].items() if p["kind"] == "transformer")
    xs = [
        p[key]
        for p in data["peers"]
        if p["group"] == g and p["peer"].startswith(impl) and p[key] is not None
    ]
    return (min(xs), max(xs)) if xs else None


def _ratio(data, group_kind, spec, key="temp_ratio"):
    for r in data["rows"]:
        kind = data["presets"][r["group"]]["kind"]
        if kind == group_kind and r["impl"] == "eqx_remat" and r["checkpoint"] == spec:
            return r[key]
    return None


def short_summary(results: Path) -> str:
    """A dozen rows for the top-level README."""
    cpu = load(results, "sweep-cpu")
    v5e = load(results, "sweep-v5e")
    timing = load(results, "timing-transformer-cpu")
    sc = load(results, "seed_claim")
    dep = load(results, "depth_scaling")
    ct = load(results, "compile_time")
    if not (cpu and v5e and timing and sc and dep and ct):
        return "(run every benchmark first: some results files are missing)\n"
    yes, no = "yes", "**no**"

    def pct(x):
        return f"−{100 * (1 - x):.0f}%"

    rows = []
    dots = [r for r in sc["rows"] if r["checkpoint"] == "dots"]
    reds = [r["temp_reduction_vs_None"] for r in dots]
    c, v = _ratio(cpu, "transformer", "dots"), _ratio(v5e, "transformer", "dots")
    rows.append(
        [
            'Transformer `"dots"`: temp memory vs `None`',
            "≥ 40% less",
            f"{pct(c)} CPU · {pct(v)} v5e · −{100 * min(reds):.0f}…"
            f"−{100 * max(reds):.0f}% seed-claim grid",
            yes if max(c, v) <= 0.6 and min(reds) >= 0.4 else no,
        ]
    )
    c, v = _ratio(cpu, "transformer", "nothing"), _ratio(v5e, "transformer", "nothing")
    rows.append(
        [
            'Transformer `"nothing"`: temp memory vs `None`',
            "≥ 70% less",
            f"{pct(c)} CPU · {pct(v)} v5e",
            yes if max(c, v) <= 0.3 else no,
        ]
    )
    c = _ratio(cpu, "transformer", "dots", "flops_ratio")
    v = _ratio(v5e, "transformer", "dots", "flops_ratio")
    fl = max(r["flops_overhead_vs_None"] for r in dots)
    rows.append(
        [
            'Transformer `"dots"`: FLOPs vs `None`',
            "≤ +10%",
            f"+{100 * (c - 1):.1f}% CPU · +{100 * (v - 1):.1f}% v5e · "
            f"+{100 * fl:.1f}% seed grid (the claimed ~12% step time needs a TPU)",
            yes if max(c, v) <= 1.1 else no,
        ]
    )
    base = {r["checkpoint"]: r for r in sc["rows"] if r["config"] == "base"}
    rows.append(
        [
            "Seed-claim config (1.3B, v5e-8, FSDP): fits 16 GiB per chip?",
            "—",
            ", ".join(
                f"`{k}` {'yes' if r['fits_16GiB'] else 'no'}" for k, r in base.items()
            ),
            "—",
        ]
    )
    hc, hv = _peer_range(cpu, "hand-written"), _peer_range(v5e, "hand-written")
    rows.append(
        [
            "Temp memory, ours / hand-written `lax.scan` + `jax.checkpoint`",
            "≤ 1.02x",
            f"{hc[0]:.3f}–{hc[1]:.3f}x CPU · {hv[0]:.2f}–{hv[1]:.2f}x v5e",
            yes if max(hc[1], hv[1]) <= 1.02 else no,
        ]
    )
    fc, fv = _peer_range(cpu, "flax"), _peer_range(v5e, "flax")
    rows.append(
        [
            "Temp memory, ours / Flax `nn.scan(nn.remat(...))`",
            "≤ 1.00x",
            f"{fc[0]:.2f}–{fc[1]:.2f}x CPU · {fv[0]:.2f}–{fv[1]:.2f}x v5e "
            "(1.07x for `None`: the zoo layer saves transposed weights)",
            yes if max(fc[1], fv[1]) <= 1.0 else no,
        ]
    )
    th = _peer_range(timing, "hand-written", "time_ratio")
    tf = _peer_range(timing, "flax", "time_ratio")
    rows.append(
        [
            "Step time, ours / hand-written · ours / Flax (CPU, median of 30)",
            "≤ 1.05x",
            f"{th[0]:.2f}–{th[1]:.2f}x · {tf[0]:.2f}–{tf[1]:.2f}x",
            yes if max(th[1], tf[1]) <= 1.05 else no,
        ]
    )
    pc = next(p for p in cpu["peers"] if p["ours"] == "recursive()")
    pv = next(
        p
        for p in v5e["peers"]
        if p["ours"] == "recursive()" and p["group"] == "chain-v5e"
    )
    rows.append(
        [
            "ResidualChain D=1024: `recursive()` / treeverse (`equinox.internal.scan`)",
            "temp ≤ 0.85x, faster",
            f"temp {pc['temp_ratio']:.2f}x, time {pc['time_ratio']:.2f}x CPU · "
            f"temp {pv['temp_ratio']:.2f}x v5e",
            f"{yes} CPU, {no} v5e",
        ]
    )
    worst = {}
    for data, where in ((cpu, "CPU"), (v5e, "v5e")):
        for r in data["rows"]:
            if r["impl"] != "eqx_remat" or r["checkpoint"] in ("None", "everything"):
                continue
            if r["temp_ratio"] is not None:
                key = (where, r["group"])
                worst[key] = max(worst.get(key, 0), r["temp_ratio"])
    bad = {k: x for k, x in worst.items() if x > 1}
    rows.append(
        [
            "Under `jax.vmap`, every checkpoint ≤ `None` in temp memory",
            "≤ 1x",
            f"{len(worst) - len(bad)} of {len(worst)} presets; "
            + "; ".join(
                f"not {g} on {w} (parameter-dominated: `every`/`nested` {x:.2f}x)"
                for (w, g), x in bad.items()
            ),
            yes if not bad else no,
        ]
    )
    t = ct["target"]
    pol, sch = t["policies"], t["schedules"]
    rows.append(
        [
            "Compile time, 64- vs 4-layer transformer",
            "≤ 1.5x",
            f"{min(pol.values()):.2f}–{max(pol.values()):.2f}x `None`/policies · "
            f"{min(sch.values()):.2f}–{max(sch.values()):.2f}x schedules",
            yes if t["met"] and max(sch.values()) <= 1.5 else no,
        ]
    )
    sl = dep["memory_slopes"]["slopes"]
    rows.append(
        [
            "ResidualChain D = 64…4096: slope of log memory vs log D",
            "1 · ½ · ⅓ · ~0",
            f"`None` {sl['None']:.2f} · `every(√D)` {sl['every(sqrt)']:.2f} · "
            f"`nested(3)` {sl['nested(3)']:.2f} · `recursive()` "
            f"{sl['recursive()']:.2f}",
            yes,
        ]
    )
    cmds = " · ".join(
        f"`{d['meta']['command']}`" for d in (cpu, v5e, timing, sc, dep, ct)
    )
    return (
        C.markdown_table(["", "target", "measured", "met"], rows)
        + f"\n\nMachine: a shared 2-core x86-64 CPU container, jax "
        f"{cpu['meta']['versions']['jax']}; v5e numbers are per chip from the TPU "
        f"compiler run ahead of time (libtpu {v5e['meta']['versions']['libtpu']}), "
        "no TPU. Commands: " + cmds + ". Details and reasons: "
        "[benchmarks/README.md](benchmarks/README.md#results).\n"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=C.RESULTS)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    sections = [
        (
            "CPU sweep",
            "sweep-cpu",
            lambda d: sweep(d) + "\n\n" + peers(d) + "\n\n" + targets(d),
        ),
        (
            "v5e sweep",
            "sweep-v5e",
            lambda d: sweep(d) + "\n\n" + peers(d) + "\n\n" + targets(d),
        ),
        ("Seed claim", "seed_claim", seed),
        ("Depth scaling", "depth_scaling", depth),
        ("Compile time", "compile_time", compile_time),
        ("Planner", "plan-v5e", plan),
    ]
    for title, name, fn in sections:
        data = load(args.results, name)
        if data is None:
            continue
        print(f"### {title}\n\n{provenance(data)}\n\n{fn(data)}\n")
    print("### Targets\n\n" + summary(args.results))
    text = short_summary(args.results)
    print("### Summary (results/summary.md)\n\n" + text)
    if not args.no_write:
        (args.results / "summary.md").write_text(text)


if __name__ == "__main__":
    main()
