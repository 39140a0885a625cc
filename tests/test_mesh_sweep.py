"""`benchmarks/mesh_sweep.py` end to end on a tiny transformer on 8 host devices:
every split of the devices under two checkpoints compiled, priced and timed,
each estimate what its columns say, and `plan` with the mesh free."""

import json
import math

import pytest
from helpers import run_script


@pytest.mark.heavy
def test_quick_compiles_prices_times_and_plans(tmp_path):
    run_script("mesh_sweep.py", "--quick", "--out", str(tmp_path))
    data = json.loads((tmp_path / "mesh_sweep_quick.json").read_text())
    rows = data["rows"]
    splits = [(r["data"], r["fsdp"]) for r in rows[::2]]
    assert splits == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert [r["checkpoint"] for r in rows[:2]] == ["None", "nothing"]
    for r in rows:
        assert r["fits"] and r["measured_s"] > 0 and r["collective_bytes"] > 0
        assert math.isclose(r["serial_s"], r["roofline_s"] + r["collective_s"])
        assert r["overlapped_s"] == max(r["roofline_s"], r["collective_s"])
    # FSDP holds an eighth of the weights per device, data parallelism all.
    by = {(r["fsdp"], r["checkpoint"]): r for r in rows}
    assert by[(8, "None")]["total_bytes"] < by[(1, "None")]["total_bytes"]
    # Recomputing a layer under FSDP gathers its weights again.
    assert by[(8, "nothing")]["collective_bytes"] > by[(8, "None")]["collective_bytes"]
    assert set(data["spearman"]) == {"roofline", "serial", "overlapped"}
    assert all(-1 <= x <= 1 for x in data["spearman"].values())
    (p,) = data["plans"]
    assert p["data"] * p["fsdp"] == 8 and p["measured"]
    assert p["memory_bytes"] <= p["budget_bytes"] and p["compiles"] >= 4
