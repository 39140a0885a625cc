"""eqx_remat.plan on the default backend (the GPU), and its pick run there.

python plan_gpu.py plan OUT.json            # None's compiled bytes, plan at half
python plan_gpu.py run OUT.json none|pick   # a fresh process: run, measure peak
"""

import json
import os
import pickle
import statistics
import sys
import time

import jax


jax.config.update("jax_platforms", os.environ.get("PLAN_PLATFORM", "cuda"))
import equinox as eqx  # noqa: E402

import eqx_remat as er  # noqa: E402
from benchmarks import _device as D, _models as M  # noqa: E402
from eqx_remat.internal import compiled_report, is_array_like  # noqa: E402


PRESET = M.PRESETS[os.environ.get("PLAN_PRESET", "transformer-v5e")]
grad = eqx.filter_grad(PRESET.loss)


def plan(path: str) -> None:
    model, batch = PRESET.build(abstract=True), PRESET.inputs(abstract=True)
    t0 = time.perf_counter()
    none = er.plan(grad, model, batch, budget_bytes=2**40, candidates=[None])
    none_bytes = none.entry.memory_bytes
    budget = none_bytes // 2
    try:
        res = er.plan(grad, model, batch, budget_bytes=budget)
    except ValueError:  # nothing fits half: three quarters
        budget = none_bytes * 3 // 4
        res = er.plan(grad, model, batch, budget_bytes=budget)
    print(res, flush=True)
    pick = [p for p in res.frontier if p.checkpoint == res.checkpoint]
    out = {
        "preset": PRESET.describe(),
        "device": D.device_kind(),
        "jax": jax.__version__,
        "none_compiled_bytes": none_bytes,
        "budget_bytes": budget,
        "pick": repr(res.checkpoint),
        "pick_compiled_bytes": res.entry.memory_bytes,
        "pick_predicted_bytes": pick[0].predicted_bytes if pick else None,
        "pick_flops": res.entry.flops,
        "none_flops": none.entry.flops,
        "notes": list(res.notes),
        "compiles": res.compiles,
        "plan_seconds": time.perf_counter() - t0,
        "frontier": [
            [repr(p.checkpoint), p.predicted_bytes, p.compiled_bytes, p.flops]
            for p in res.frontier
        ],
    }
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    with open(path + ".pick", "wb") as f:
        pickle.dump(res.checkpoint, f)


def run(path: str, which: str) -> None:
    checkpoint = None
    if which == "pick":
        with open(path.replace(".run-pick.json", ".json") + ".pick", "rb") as f:
            checkpoint = pickle.load(f)
    params, static = eqx.partition(PRESET.build(checkpoint), is_array_like)
    batch = PRESET.inputs()
    fn = lambda p, b: grad(eqx.combine(p, static), b)  # noqa: E731
    compiled = jax.jit(fn).lower(params, batch).compile()
    report = compiled_report(compiled, flops=0, target="gpu")
    before = D.peak_bytes_in_use()
    out = {
        "checkpoint": repr(checkpoint),
        "compiled_bytes": report.total_bytes,
        "temp_bytes": report.temp_bytes,
        "argument_bytes": report.argument_bytes,
        "output_bytes": report.output_bytes,
        "peak_before_step": before,
    }
    try:
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(params, batch))
            times.append(time.perf_counter() - t0)
        out |= {
            "peak_bytes": D.peak_bytes_in_use(),
            "step_s": statistics.median(times[1:]),
            "times_s": times,
        }
    except Exception as e:  # out of memory
        out |= {
            "error": str(e).splitlines()[0][:300],
            "peak_bytes": D.peak_bytes_in_use(),
        }
    print(json.dumps(out), flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "plan":
        plan(sys.argv[2])
    else:
        run(sys.argv[2], sys.argv[3])
