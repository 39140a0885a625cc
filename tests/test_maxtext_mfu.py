"""`benchmarks/maxtext_mfu.py`: MaxText's configs as its code derives them, the
FLOPs convention of its published MFU, the one factor, and the script end to end
on a tiny config (compiled for v5e, nothing timed)."""

import csv
import json
import math

import pytest
from helpers import needs_libtpu, run_script

import eqx_remat as er
from benchmarks import maxtext_mfu as mm


# MaxText's "16B" ... "128B": the names are the parameter counts, in billions
# (then, on several slices, "-2x" ... "-32x").
V5E = [n for n in mm.CONFIGS if not n.startswith(("v5p", "llama"))]
V5P = [n for n in mm.CONFIGS if n.startswith("v5p")]
LLAMA = [n for n in mm.CONFIGS if n.startswith("llama")]


@pytest.mark.parametrize("name", V5E)
def test_configs_are_maxtexts_models(name):
    c = mm.CONFIGS[name]
    billions = mm.maxtext_params(c) / 1e9
    size, _, slices = name.partition("-")
    assert abs(billions / int(size[:-1]) - 1) < 0.03, (name, billions)
    assert c.slices == (int(slices[:-1]) if slices else 1)
    assert c.target == (f"{slices}v5e:16x16" if slices else "v5e:16x16")
    assert er.internal.slice_count(c.target) == c.slices
    # The same model on every count of slices; only what was measured differs,
    # and 128b's remat policy on several slices (MaxText's configs/v5e/128b.sh).
    one = mm.CONFIGS[size]
    policy = ("full", "nothing")
    if size == "128b" and slices:
        policy = ("qkv_proj_offloaded", "offload_names(qkv_proj, dst=pinned_host)")
    assert (c.remat_policy, c.checkpoint) == policy
    same = dict(slices=1, published_mfu=None, published_tflops=None)
    assert c._replace(**same, remat_policy="full", checkpoint="nothing") == (
        one._replace(**same)
    )
    # MaxText's 128b ran with ici_fsdp_parallelism=16 ici_tensor_parallelism=16;
    # the others FSDP over a slice.
    assert c.tensor == (16 if size == "128b" else 1)
    # The published TFLOP/s per chip is the MFU of 197 TFLOP/s, to its rounding.
    assert abs(c.published_tflops / 197 - c.published_mfu) < 0.005
    assert c.topology == "v5e:16x16"
    er.parse_checkpoint(c.checkpoint, mm.dims(c).layers)  # a checkpoint


@pytest.mark.parametrize("name", V5P)
def test_v5p_configs_are_maxtexts_v5p_runs(name):
    """ "v5p-32b-128-2x": MaxText's 32B on 2 slices of v5p-128 (64 chips each:
    v5p-N names count TensorCores, 2 a chip), as its first v5p table ran them
    (76bd53b0): the v5e runs' dims, `minimal` remat up to 256B, `full` above,
    causal attention counted half in the published MFU."""
    c = mm.CONFIGS[name]
    _, size, cores, *slices = name.split("-")
    billions = mm.maxtext_params(c) / 1e9
    assert abs(billions / int(size[:-1]) - 1) < 0.03, (name, billions)
    assert c.slices == (int(slices[0][:-1]) if slices else 1)
    assert er.internal.slice_count(c.target) == c.slices
    assert math.prod(er.internal.slice_shape(c.topology)) == int(cores) // 2
    assert c.topology.startswith("v5p:") and c.causal_half
    assert c.base == mm.CONFIGS["16b"].base and c.head_dim == 256
    big = int(size[:-1]) > 256
    assert (c.remat_policy, c.checkpoint) == (
        ("full", "nothing") if big else ("minimal", "dots_no_batch")
    )
    assert c.tensor == {32: 4, 64: 4, 128: 8, 256: 8}.get(int(size[:-1]), 16)
    # The published TFLOP/s per chip is the MFU of a v5p chip's 459 TFLOP/s.
    assert abs(c.published_tflops / 459 - c.published_mfu) < 0.005
    er.parse_checkpoint(c.checkpoint, mm.dims(c).layers)


@pytest.mark.parametrize("name", LLAMA)
def test_llama_configs_are_maxtexts_tiering_runs(name):
    """ "llama3.1-70b-v6e": MaxText's Llama 3.1 70B on v6e-256, as its tiering
    page links it: Meta's dims, 8 KV heads, FSDP over every chip, its batch
    and remat policy, causal attention counted in full."""
    c = mm.CONFIGS[name]
    size, generation = name.split("-")[1], name.split("-")[2]
    billions = mm.maxtext_params(c) / 1e9
    assert abs(billions / int(size[:-1]) - 1) < 0.05, (name, billions)
    assert c.topology.startswith(f"{generation}:") and c.slices == c.tensor == 1
    chips = math.prod(er.internal.slice_shape(c.topology))
    assert chips == {"v6e": 256, "v5p": 512}[generation]
    assert c.kv_heads == 8 and not c.causal_half and c.llama == mm.dims(c)
    assert c.vocab == (128256 if name.startswith("llama3") else 32000)
    assert c.seq == (8192 if name.startswith("llama3") else 4096)
    if c.remat_policy == "custom":  # the layer input and projections offloaded
        assert c.checkpoint.startswith("offload_names(layer_input,")
    er.parse_checkpoint(c.checkpoint, mm.dims(c).layers)


def test_llama_flops_leave_out_the_input_embedding():
    """MaxText's count: the untied input embedding is a lookup, no FLOPs; the
    head is a product. Its published MFU follows from its tokens/s so."""
    c = mm.CONFIGS["llama3.1-8b-v6e"]
    params = mm.counted_params(c, mm.maxtext_params(c))
    assert params == mm.maxtext_params(c) - c.vocab * c.llama.emb
    assert mm.counted_params(mm.CONFIGS["16b"], 100) == 100  # tied: the head
    flops = mm.model_flops(params, c.llama, 1, c.seq) / c.seq  # per token
    mfu = flops * 7207 / 918e12  # the page's tokens/s a chip, a v6e's peak
    assert abs(mfu - c.published_mfu) < 0.002


def test_dims_follow_get_individual_scales():
    """log2 of the scale rotates: heads and MLP, then the embedding, then the
    layers (MaxText's pyconfig); 16B is 5120 wide, 32 heads, 32 layers."""
    assert mm.dims(mm.CONFIGS["16b"]) == (5120, 32, 32768, 32, 256)
    assert mm.dims(mm.CONFIGS["32b"]) == (10240, 32, 32768, 32, 256)
    assert mm.dims(mm.CONFIGS["64b"]) == (10240, 32, 32768, 64, 256)
    assert mm.dims(mm.CONFIGS["128b"]) == (10240, 64, 65536, 64, 256)
    with pytest.raises(ValueError, match="power of 2"):
        mm.dims(mm.CONFIGS["16b"]._replace(scale=12))


def test_model_flops_count_causal_attention_in_full():
    d = mm.Dims(emb=4, heads=2, mlp=8, layers=3, head_dim=5)
    weights = 6 * 100 * 7 * 2  # 6 N per token, 7 tokens, batch 2
    attention = 12 * 2 * 3 * 5 * 49 * 2
    assert mm.model_flops(100, d, batch=2, seq=7) == weights + attention
    # From 76bd53b0 (the v5p table), causal attention counted half.
    half = mm.model_flops(100, d, batch=2, seq=7, causal_half=True)
    assert half == weights + attention / 2


def test_factor_is_the_median_ratio():
    rows = [
        mm.Row(*(None,) * len(mm.Row._fields))._replace(config=n, ratio=x)
        for n, x in (("a", 0.6), ("b", None), ("c", 0.9), ("d", 0.7))
    ]
    f = mm.factor(rows)
    assert f["value"] == 0.7 and f["ratios"] == {"a": 0.6, "c": 0.9, "d": 0.7}
    assert "9bc243c" in f["source"]
    assert mm.factor(rows[1:2])["value"] is None
    assert f["collectives"] == {}  # no collectives compiled


def test_each_model_of_overlap_is_held_against_the_runs_unfitted():
    """Published over estimated MFU per run, its median, the furthest from
    it, and the ranking, for each overlap model of the collectives."""
    blank = mm.Row(*(None,) * len(mm.Row._fields))
    runs = (("a", 0.6, 0.5, 0.6), ("b", 0.5, 0.5, 0.4), ("c", 0.4, 0.5, 0.2))
    rows = [
        blank._replace(
            config=n, ratio=1.0, published_mfu=p, serial_mfu=s, overlapped_mfu=o
        )
        for n, p, s, o in runs
    ]
    f = mm.factor(rows)["collectives"]
    assert f["serial"]["ratios"] == {"a": 1.2, "b": 1.0, "c": 0.8}
    assert f["serial"]["median"] == 1.0
    assert f["serial"]["most_off"] == pytest.approx(0.2)
    assert f["overlapped"]["spearman"] == pytest.approx(1.0)
    assert f["overlapped"]["ratios"]["c"] == 2.0
    assert f["overlapped"]["one_slice"] == pytest.approx(1.0)
    # The one factor and the one-slice ranking are of one slice's runs.
    rows[2] = rows[2]._replace(target="2xv5e:16x16")
    f = mm.factor(rows)
    assert f["collectives"]["overlapped"]["one_slice"] is None  # too few to rank
    assert f["collectives"]["overlapped"]["spearman"] == pytest.approx(1.0)
    assert list(f["ratios"]) == ["a", "b"]
    # Each TPU's runs are ranked on their own too; v5e's factor is v5e's alone.
    rows[0] = rows[0]._replace(target="v5p:4x4x4")
    f = mm.factor(rows)
    by = f["collectives"]["serial"]["by_tpu"]
    assert {k: v["runs"] for k, v in by.items()} == {"v5p": 1, "v5e": 2}
    assert by["v5e"]["most_off"] == pytest.approx(0.1 / 0.9)  # 1.0, 0.8: median 0.9
    assert by["v5p"]["spearman"] is None  # one run: nothing to rank
    assert list(f["ratios"]) == ["b"]


@needs_libtpu
def test_quick_compiles_prices_and_writes(tmp_path):
    """The script's whole path on a tiny config on v5e:2x2: compiled (per-chip
    memory), priced by the roofline, MFU and HFU from it, JSON and CSV."""
    proc = run_script("maxtext_mfu.py", "--quick", "--out", str(tmp_path), timeout=600)
    data = json.loads((tmp_path / "maxtext_mfu_quick.json").read_text())
    assert data["meta"]["command"] == "python benchmarks/maxtext_mfu.py --quick " + (
        f"--out {tmp_path}"
    )
    with (tmp_path / "maxtext_mfu_quick.csv").open() as f:
        assert [r["config"] for r in csv.DictReader(f)] == ["tiny"]
    (row,) = data["rows"]
    assert row["config"] == "tiny" and row["checkpoint"] == "nothing"
    assert row["fits"] and row["chips"] == 4 and row["roofline_s"] > 0
    peak = 197e12
    mfu = row["model_flops_per_chip"] / (row["roofline_s"] * peak)
    assert math.isclose(row["predicted_mfu"], mfu)
    # Recomputing the forward pass: more FLOPs executed than the model's.
    assert row["predicted_hfu"] > row["predicted_mfu"]
    assert row["published_mfu"] is None and data["factor"]["value"] is None
    # FSDP over the 4 chips: the weights gathered and the gradients reduced,
    # priced at one direction of a v5e chip's 400 GB/s of ICI.
    assert row["collective_bytes"] > 0
    assert math.isclose(row["collective_s"], row["collective_bytes"] / 200e9)
    step = row["roofline_s"] + row["collective_s"]
    assert math.isclose(row["serial_mfu"], row["model_flops_per_chip"] / (step * peak))
    assert row["overlapped_mfu"] <= row["predicted_mfu"]
    assert "est. MFU" in proc.stdout and "roofline" in proc.stdout
