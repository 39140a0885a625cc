"""The roofline against published TPU runs: MaxText's v5e-256 MFU beside the MFU
the planner's roofline predicts for the same models.

MaxText publishes the MFU of its 16B, 32B, 64B and 128B models trained on one
TPU v5e-256 slice (61.10%, 66.86%, 59.90%, 56.06%: the v5e table of its README,
now `src/maxtext/configs/tpu/v5e/README.md`). The table was measured in October
2023 (google/maxtext 9bc243c, "Fix performance numbers") with
`MaxText/configs/largest_job/{16b,32b,64b,128b}.sh` and that day's `base.yml`:
`global_parameter_scale` 16 to 128 over base dims 2560 / 8 heads of 256 / MLP
8192 / 16 layers, ReLU MLP, tied embeddings, vocab 32768, seq 2048, bf16
activations, float32 weights, `remat_policy=full`, flash attention, per-device
batch 6, 4, 2, 1. Each is rebuilt here with `zoo.Transformer` (the same matrix
shapes: `head_dim` 256, `d_ff` the MLP dim, tied embeddings; rotary positions
and a sequential block where MaxText had relative position biases and a
parallel one, which change no matrix product), parameters and batch sharded over
the 256 chips (FSDP), `checkpoint="nothing"` for `full`, compiled ahead of time
for `v5e:16x16` (per-chip memory, no TPU) and priced with
`eqx_remat.internal.roofline_seconds`.

Predicted MFU = model FLOPs per chip / (roofline seconds x 197 TFLOP/s), in the
published figures' own convention (MaxText's `calculate_training_tflops` of
that commit): 6 x parameters x tokens + 12 x heads x layers x head_dim x seq^2 x
batch, causal attention counted in full, no recomputation. HFU: the FLOPs the
step executes (`eqx_remat.count_flops`, recomputation included). The ratio
published / predicted says how far the roofline is from a run.

MaxText publishes the same four models on 2 to 32 v5e-256 slices joined by the
data center network (DCN) too (its v5e README's table, from
`MaxText/configs/v5e/*.sh`: the same settings, the slices data parallel,
`dcn_data_parallelism`): each is compiled for `Nxv5e:16x16`, the data axis
spanning the slices and FSDP within each (`eqx_remat.v5e_mesh(target,
fsdp=256)`). The 128B runs were measured with `ici_fsdp_parallelism=16
ici_tensor_parallelism=16`, and so are they here (`v5e_mesh(target, fsdp=16,
tensor=16)`: the zoo's tensor parallelism); on 2 to 32 slices with
`remat_policy=qkv_proj_offloaded`, here `offload_names(qkv_proj,
dst=pinned_host)`.

The roofline counts nothing that crosses chips. Beside it: the bytes each chip
sends per step in the compiled program's collectives
(`MemoryReport.collective_bytes`, loop trip counts included) at one direction
of a v5e chip's published ICI bandwidth (200 GB/s), and what it sends other
slices (`MemoryReport.network_bytes`) at a chip's share of its host's DCN
(3.125 GB/s), under two stated models of overlap, neither fitted: *serial* (the
step is the roofline's time plus the collectives') and *overlapped* (the larger
of the two: XLA schedules collectives asynchronously on TPU, beside the
compute).

MaxText's tiering page adds Llama runs: Llama 2 70B (43.8%), Llama 3.1 8B
(45.46%) and Llama 3.1 70B (50.33%) on v6e-256, and Llama 2 70B on 512 v5p chips
(65.4%), each rebuilt with `zoo.Transformer` (SwiGLU, 8 KV heads, untied head)
and compiled with its linked settings: FSDP over every chip, its batch, and its
remat policy (`full`: `"nothing"`; `custom` offloading the layer input and q, k,
v (and out) projections: `offload_names(...)`; `save_dot_except_mlpwi`:
`save_names(mlp_out, out_proj, qkv_proj)`).

    python benchmarks/maxtext_mfu.py                  # every run, 1 to 32 slices
    python benchmarks/maxtext_mfu.py --preset 16b 32b # one slice each
    python benchmarks/maxtext_mfu.py --preset 16b-2x  # 16b on 2 slices
    python benchmarks/maxtext_mfu.py --quick          # one tiny model on v5e:2x2
"""

import argparse
import functools
import math
import statistics
import time
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_remat as er
import zoo
from benchmarks import (
    _cli,
    _console,
    _ending,
    _format,
    _measure,
    _models,
    _results,
    _table,
    _targets,
)
from eqx_remat.internal import (
    collective_time,
    hardware,
    is_array_like,
)


SOURCE = (
    "github.com/google/maxtext 9bc243c (2023-10-27), README.md 'TPU v5e' and "
    "MaxText/configs/largest_job/*.sh + base.yml (still the table of "
    "AI-Hypercomputer/maxtext src/maxtext/configs/tpu/v5e/README.md); 2 to 32 "
    "slices: that table (AI-Hypercomputer/maxtext e64f681, "
    "MaxText/configs/v5e/README.md and v5e/*.sh)"
)


class Dims(NamedTuple):
    emb: int
    heads: int
    mlp: int
    layers: int
    head_dim: int


class Config(NamedTuple):
    """One MaxText run: its `global_parameter_scale` over `base.yml`'s dims, its
    batch and remat policy, and what it measured (`None`: nothing published)."""

    scale: int  # global_parameter_scale
    per_device_batch: int
    published_mfu: float | None
    published_tflops: float | None  # TFLOP/s per chip, as published
    remat_policy: str = "full"  # MaxText's
    checkpoint: str = "nothing"  # ours: the same decisions
    topology: str = "v5e:16x16"
    seq: int = 2048  # max_target_length
    vocab: int = 32768
    # base.yml of 9bc243c: base_emb_dim, base_num_heads, base_mlp_dim,
    # base_num_decoder_layers; head_dim
    base: tuple[int, int, int, int] = (2560, 8, 8192, 16)
    head_dim: int = 256
    slices: int = 1  # slices, data parallel over the DCN
    tensor: int = 1  # ici_tensor_parallelism; FSDP over the rest of a slice
    # The published MFU's FLOPs of causal attention: in full (9bc243c's
    # `calculate_training_tflops`, the v5e table), or half (76bd53b0's on, the
    # v5p table).
    causal_half: bool = False
    # A Llama (MaxText's `llama2` decoder block: SwiGLU, grouped-query
    # attention with `kv_heads`, an untied head) of these dims; else MaxText's
    # default decoder of `scale` (`None`).
    llama: Dims | None = None
    kv_heads: int | None = None

    @property
    def target(self) -> str:
        """What it is compiled for: `topology`, on `slices` slices."""
        return self.topology if self.slices == 1 else f"{self.slices}x{self.topology}"


CONFIGS = {
    "16b": Config(16, 6, 0.6110, 120),
    "32b": Config(32, 4, 0.6686, 132),
    "64b": Config(64, 2, 0.5990, 118),
    # ici_fsdp_parallelism=16 ici_tensor_parallelism=16.
    "128b": Config(128, 1, 0.5606, 110, tensor=16),
}
# On 2 to 32 slices MaxText ran 128b with remat_policy=qkv_proj_offloaded
# (`configs/v5e/128b.sh`): the q/k/v projections offloaded to the host, the
# rest recomputed.
_OFFLOADED = {
    "remat_policy": "qkv_proj_offloaded",
    "checkpoint": "offload_names(qkv_proj, dst=pinned_host)",
}
# MaxText's v5e table: (slices, MFU, TFLOP/s per chip) on 2 to 32 v5e-256.
MULTISLICE = {
    "16b": ((2, 0.5937, 117), (4, 0.5914, 117), (8, 0.5827, 115), (16, 0.5656, 111),
            (32, 0.5465, 108)),
    "32b": ((2, 0.6481, 128), (4, 0.6410, 126), (8, 0.6367, 125), (16, 0.6226, 123),
            (32, 0.6040, 119)),
    "64b": ((2, 0.5666, 112), (4, 0.5585, 110), (8, 0.5496, 108), (16, 0.5329, 105),
            (32, 0.5018, 99)),
    "128b": ((2, 0.5582, 110), (4, 0.5493, 108), (8, 0.5293, 104), (16, 0.5086, 100),
             (32, 0.4625, 91)),
}  # fmt: skip
CONFIGS |= {
    f"{n}-{k}x": CONFIGS[n]._replace(
        slices=k,
        published_mfu=mfu,
        published_tflops=t,
        **(_OFFLOADED if n == "128b" else {}),
    )
    for n, runs in MULTISLICE.items()
    for k, mfu, t in runs
}
# MaxText's v5p table (MaxText/configs/v5p/README.md, from its first commit,
# 76bd53b0 of 2023-12-15): (slices, chips of a slice's topology, MFU, TFLOP/s
# per chip), run with that commit's `configs/v5p/*.sh` and base.yml (the v5e
# runs' dims): per-device batch 8, 4, 2, 2, 2, 2; remat `minimal`
# (`checkpoint_dots_with_no_batch_dims`) to 256b, `full` above;
# `ici_tensor_parallelism` 4, 4, 8, 8, 16, 16, FSDP over the rest of a slice.
# A v5p-N slice has N / 2 chips: v5p-128 is 4x4x4.
V5P_SOURCE = (
    "AI-Hypercomputer/maxtext 76bd53b0 (2023-12-15), MaxText/configs/v5p/"
    "README.md and v5p/*.sh + base.yml"
)
_V5P_TOPOLOGY = {
    128: "v5p:4x4x4",
    256: "v5p:4x4x8",
    512: "v5p:4x8x8",
    1024: "v5p:8x8x8",
    2048: "v5p:8x8x16",
    4096: "v5p:8x16x16",
}
V5P = {
    # name: (scale, batch, remat policy, tensor, runs: (slices, v5p-N, MFU, TFLOP/s))
    "32b": (32, 8, "minimal", 4, ((1, 128, 0.7147, 328), (2, 128, 0.6943, 319))),
    "64b": (64, 4, "minimal", 4, ((1, 128, 0.7031, 323), (2, 128, 0.6726, 309))),
    "128b": (128, 2, "minimal", 8, ((1, 256, 0.6868, 315), (2, 256, 0.6634, 305),
                                    (1, 512, 0.6883, 316), (2, 512, 0.5966, 274))),
    "256b": (256, 2, "minimal", 8, ((1, 1024, 0.6709, 308), (2, 1024, 0.6299, 289))),
    "512b": (512, 2, "full", 16, ((1, 1024, 0.6399, 294), (2, 1024, 0.6145, 282))),
    "1024b": (1024, 2, "full", 16, ((1, 2048, 0.5535, 254), (2, 2048, 0.5155, 237),
                                    (1, 4096, 0.6480, 297), (2, 4096, 0.6083, 279))),
}  # fmt: skip
_OURS = {"minimal": "dots_no_batch", "full": "nothing"}
CONFIGS |= {
    f"v5p-{n}-{cores}" + (f"-{k}x" if k > 1 else ""): Config(
        scale,
        batch,
        mfu,
        t,
        remat_policy=policy,
        checkpoint=_OURS[policy],
        topology=_V5P_TOPOLOGY[cores],
        slices=k,
        tensor=tensor,
        causal_half=True,
    )
    for n, (scale, batch, policy, tensor, runs) in V5P.items()
    for k, cores, mfu, t in runs
}
# MaxText's tiering page (docs/reference/models/tiering.md of
# AI-Hypercomputer/maxtext e591f30, 2026-08): its Llama runs on v6e-256 and
# v5p (MFU, tokens/s a chip), each with the settings of the commit the page
# links (92e59fdf, 2025-09-26: benchmarks/maxtext_trillium_model_configs.py
# and maxtext_v5p_model_configs.py; models from src/MaxText/configs/models):
# per-device batch, FSDP over every chip, the remat policy. Their MFU counts
# causal attention in full, as the v5e table does: 6 x (parameters less the
# input embedding) x tokens + full attention gives their MFU from their
# tokens/s to 0.2% (e.g. Llama 3.1 8B: 45.45% against 45.46%).
TIERING_SOURCE = (
    "AI-Hypercomputer/maxtext e591f30, docs/reference/models/tiering.md, with "
    "the settings of 92e59fdf (2025-09-26) benchmarks/maxtext_trillium_model_"
    "configs.py and maxtext_v5p_model_configs.py"
)
SOURCES = f"{SOURCE}; TPU v5p: {V5P_SOURCE}; Llama on TPU v6e and v5p: {TIERING_SOURCE}"
_LLAMA2_70B = Dims(8192, 64, 28672, 80, 128)
_LLAMA31_8B = Dims(4096, 32, 14336, 32, 128)
# MaxText's `custom` remat: decoder_layer_input, query/key/value_proj (and
# out_proj for 8B) offloaded, the rest recomputed; `save_dot_except_mlpwi`:
# save_only_these_names(query/key/value/qkv_proj, out_proj, mlpwo).
_OFFLOAD_QKV = "offload_names(layer_input, qkv_proj, dst=pinned_host)"
_OFFLOAD_QKV_OUT = "offload_names(layer_input, out_proj, qkv_proj, dst=pinned_host)"
_LLAMA = {
    # name: (dims, vocab, seq, batch, MFU, remat policy, ours, topology)
    "llama2-70b-v6e": (_LLAMA2_70B, 32000, 4096, 4, 0.438, "full", "nothing",
                       "v6e:16x16"),
    "llama3.1-8b-v6e": (_LLAMA31_8B, 128256, 8192, 4, 0.4546, "custom",
                        _OFFLOAD_QKV_OUT, "v6e:16x16"),
    "llama3.1-70b-v6e": (_LLAMA2_70B, 128256, 8192, 5, 0.5033, "custom",
                         _OFFLOAD_QKV, "v6e:16x16"),
    "llama2-70b-v5p": (_LLAMA2_70B, 32000, 4096, 4, 0.654, "save_dot_except_mlpwi",
                       "save_names(mlp_out, out_proj, qkv_proj)", "v5p:8x8x8"),
}  # fmt: skip
CONFIGS |= {
    name: Config(
        1,
        batch,
        mfu,
        None,
        remat_policy=policy,
        checkpoint=ours,
        topology=topology,
        seq=seq,
        vocab=vocab,
        head_dim=d.head_dim,
        llama=d,
        kv_heads=8,
    )
    for name, (d, vocab, seq, batch, mfu, policy, ours, topology) in _LLAMA.items()
}
QUICK = {
    "tiny": Config(
        1, 1, None, None, topology="v5e:2x2", seq=256, vocab=512,
        base=(256, 2, 512, 2), head_dim=128,
    ),
}  # fmt: skip


def dims(c: Config) -> Dims:
    """A Llama's own; else MaxText's `get_individual_scales`: the scale's log2
    rotates between doubling the heads and MLP, the embedding and the layers."""
    if c.llama is not None:
        return c.llama
    log2 = int(math.log2(c.scale))
    if 2**log2 != c.scale:
        raise ValueError(f"expected a power of 2 for the scale. Got {c.scale}.")
    base, rem = divmod(log2, 3)
    heads_mlp, emb = base + (rem > 0), base + (rem > 1)
    e, h, m, n = c.base
    return Dims(e << emb, h << heads_mlp, m << heads_mlp, n << base, c.head_dim)


def maxtext_params(c: Config) -> int:
    """The parameters of MaxText's model of that commit: tied embedding, per
    layer q, k, v, out (`emb x heads x head_dim`), ReLU MLP `wi`, `wo`, and
    the norms (pre-attention, query, key; final), relative position biases (32
    buckets per head); a Llama's: embedding and head, per layer q, out, k and
    v of `kv_heads`, SwiGLU's three matrices, two norms; the final norm."""
    d, vocab = dims(c), c.vocab
    if c.llama is not None:
        attention = d.emb * d.head_dim * (2 * d.heads + 2 * (c.kv_heads or d.heads))
        layer = attention + 3 * d.emb * d.mlp + 2 * d.emb
        return 2 * vocab * d.emb + d.layers * layer + d.emb
    width = d.heads * d.head_dim
    layer = 4 * d.emb * width + 2 * d.emb * d.mlp + d.emb + 2 * d.head_dim
    return vocab * d.emb + d.layers * (layer + 32 * d.heads) + d.emb


def counted_params(c: Config, params: int) -> int:
    """Of a model's `params`, those the published FLOPs count: every one but
    an untied input embedding (a lookup, not a product; a tied one is the
    output head's product too)."""
    return params - (0 if c.llama is None else c.vocab * dims(c).emb)


def model_flops(
    params: int, d: Dims, batch: int, seq: int, causal_half: bool = False
) -> float:
    """Training FLOPs per chip as the published MFU counts them (MaxText's
    `calculate_training_tflops` at 9bc243c): `6 N` per token and causal
    attention in full, `12 heads layers head_dim seq^2` per sequence; with
    `causal_half` (at 76bd53b0), half of that attention."""
    attention = 12 * d.heads * d.layers * d.head_dim * seq**2 * batch
    return 6 * params * seq * batch + attention / (2 if causal_half else 1)


class Row(NamedTuple):
    """One config under one checkpoint: compiled for its slice (per chip) and
    priced by the roofline (one chip's step)."""

    config: str
    checkpoint: str
    remat_policy: str | None  # MaxText's, where `checkpoint` is its counterpart
    target: str
    chips: int
    params: int  # the zoo model's
    maxtext_params: int  # MaxText's model's (norms and position biases differ)
    model_flops_per_chip: float  # the published convention, the zoo model's
    counted_flops_per_chip: float | None  # count_flops: recomputation included
    roofline_s: float  # an estimate
    predicted_mfu: float
    predicted_hfu: float | None
    published_mfu: float | None
    published_tflops: float | None
    # The step time the published MFU implies for these FLOPs (the models'
    # parameters agree to 0.01%): the measured time the roofline estimates.
    published_step_s: float | None
    ratio: float | None  # published / predicted MFU = roofline_s / published_step_s
    temp_bytes: int | None  # per chip; where XLA refuses, what it says it needs
    total_bytes: int | None
    fits: bool
    compile_s: float
    error: str | None
    # What each chip sends per step in collectives within its slice and to
    # other slices (None: not compiled), and the seconds that takes at the
    # chip's ICI and DCN bandwidth (an estimate).
    collective_bytes: int | None = None
    network_bytes: int | None = None
    collective_s: float | None = None
    serial_mfu: float | None = None  # step = roofline + collectives
    overlapped_mfu: float | None = None  # step = max(roofline, collectives)


def make(c: Config, checkpoint: er.Checkpoint) -> zoo.Transformer:
    """The zoo model of `c`, only shapes: MaxText's matrices, bf16 compute."""
    d = dims(c)
    build = functools.partial(
        zoo.Transformer,
        c.vocab,
        c.seq,
        d.emb,
        d.heads,
        d.layers,
        d_ff=d.mlp,
        head_dim=d.head_dim,
        dtype=jnp.bfloat16,
        attention="flash",
        norm="rms",
        position="rope",
        use_bias=False,
        tie_embeddings=True,
        checkpoint=checkpoint,
        key=jax.random.key(0),
    )
    if c.llama is not None:
        build = functools.partial(
            build,
            mlp="swiglu",
            num_kv_heads=c.kv_heads,
            tie_embeddings=False,
        )
    return eqx.filter_eval_shape(build)


def describe(c: Config) -> str:
    d, chips = dims(c), math.prod(er.internal.slice_shape(c.topology) or (1,))
    return (
        f"d_model {d.emb}, {d.heads} heads of {d.head_dim}, MLP {d.mlp}, "
        f"{d.layers} layers, vocab {c.vocab}, seq {c.seq}, batch "
        f"{c.per_device_batch}/chip, bf16, flash, "
        + ("" if c.llama is None else f"Llama ({c.kv_heads} KV heads, SwiGLU), ")
        + (f"FSDP {chips // c.tensor} x tensor {c.tensor}" if c.tensor > 1 else "FSDP")
    )


_AXES = ("data", "fsdp")


def _loss(model: zoo.Transformer, tokens: jax.Array) -> jax.Array:
    # The flash kernel runs per chip: the vmap's batch axis is the mesh's.
    return _models.cross_entropy(jax.vmap(model, spmd_axis_name=_AXES)(tokens), tokens)


def _step(mesh: Any, model: zoo.Transformer, tokens: jax.Array) -> Any:
    """The gradient of the loss, kept sharded like the parameters (FSDP)."""
    grads = eqx.filter_grad(_loss)(model, tokens)
    return zoo.shard(grads, mesh, fsdp=True, axis="fsdp")


def measure(name: str, c: Config, spec: str) -> Row:
    """`c` under the checkpoint `spec`: compiled for `c.target`, priced by the
    roofline, beside what MaxText published (for its own policy only)."""
    checkpoint = er.parse_checkpoint(spec, dims(c).layers)
    # FSDP over a slice's chips, data parallel over the slices (MaxText's
    # ici_fsdp_parallelism=-1, dcn_data_parallelism=-1).
    per_slice = er.v5e_mesh(c.topology).size
    mesh = er.v5e_mesh(c.target, fsdp=per_slice // c.tensor, tensor=c.tensor)
    model = zoo.shard(make(c, checkpoint), mesh, fsdp=True, axis="fsdp")
    batch = jax.ShapeDtypeStruct((c.per_device_batch * mesh.size, c.seq), jnp.int32)
    tokens = zoo.shard_batch(batch, mesh, axis=_AXES)
    fn = functools.partial(_step, mesh)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):  # the flash kernel finds its mesh in the context
        compiled = _measure.compiled_aot(fn, (model, tokens), c.target)
        compile_s = time.perf_counter() - t0
        roofline = er.internal.roofline_seconds(fn, model, tokens, target=c.target)
    leaves = jax.tree.leaves(eqx.filter(model, is_array_like))
    params = sum(x.size for x in leaves)
    hw = hardware(c.topology)[0]
    peak = hw.peak_flops
    batch = c.per_device_batch
    flops = model_flops(counted_params(c, params), dims(c), batch, c.seq, c.causal_half)
    counted = None if compiled["flops"] is None else compiled["flops"] / mesh.size
    mfu = flops / (roofline * peak)
    sent, network = compiled["collective_bytes"], compiled.get("network_bytes")
    comm = None if sent is None else collective_time(hw, sent, network or 0)
    own = spec == c.checkpoint
    published = c.published_mfu if own else None
    return Row(
        config=name,
        checkpoint=er.checkpoint_label(checkpoint),
        remat_policy=c.remat_policy if own else None,
        target=c.target,
        chips=mesh.size,
        params=params,
        maxtext_params=maxtext_params(c),
        model_flops_per_chip=flops,
        counted_flops_per_chip=counted,
        roofline_s=roofline,
        predicted_mfu=mfu,
        predicted_hfu=None if counted is None else counted / (roofline * peak),
        published_mfu=published,
        published_tflops=c.published_tflops if own else None,
        published_step_s=None if published is None else flops / (published * peak),
        ratio=None if published is None else published / mfu,
        temp_bytes=compiled["temp_bytes"],
        total_bytes=compiled["total_bytes"],
        fits=compiled["fits"],
        compile_s=compile_s,
        error=compiled["error"],
        collective_bytes=sent,
        network_bytes=network,
        collective_s=comm,
        serial_mfu=None if comm is None else flops / ((roofline + comm) * peak),
        overlapped_mfu=None if comm is None else flops / (max(roofline, comm) * peak),
    )


def factor(rows: list[Row]) -> dict[str, Any]:
    """The one figure taken from the comparison: the median of published over
    predicted MFU of the v5e runs on one slice (`None` where nothing published
    was measured; the factor v5e's estimates are printed with), and how the
    roofline ranks those runs against how they measured (Spearman; not
    fitted): with the collectives, over every run (every TPU) and over the
    runs on one slice."""
    mine = [r for r in rows if r.ratio is not None]
    one = [r for r in mine if er.internal.slice_count(r.target) == 1]
    v5e = [r for r in one if _tpu(r) == "v5e"]
    ratios = {r.config: r.ratio for r in v5e}
    predicted = [r.predicted_mfu for r in v5e]
    published = [r.published_mfu for r in v5e]
    overlap = {}
    for model in ("serial", "overlapped"):
        est = {r.config: getattr(r, f"{model}_mfu") for r in mine}
        if not est or None in est.values():
            continue
        each = {n: r.published_mfu / est[n] for n, r in zip(est, mine)}
        mid = statistics.median(each.values())
        pairs = [(est[r.config], r.published_mfu) for r in mine]
        overlap[model] = {
            "ratios": each,
            "median": mid,
            "most_off": _most_off(list(each.values())),
            "spearman": _targets.spearman(*zip(*pairs)),
            "one_slice": _targets.spearman(
                [est[r.config] for r in one], [r.published_mfu for r in one]
            ),
            # Each TPU's runs on their own: their ranking, their spread.
            "by_tpu": {
                tpu: _held([r for r in mine if _tpu(r) == tpu], est, each)
                for tpu in dict.fromkeys(map(_tpu, mine))
            },
        }
    return {
        "name": "measured fraction of the roofline: median of published / "
        "predicted MFU",
        "value": statistics.median(ratios.values()) if ratios else None,
        "ratios": ratios,
        "spearman": _targets.spearman(predicted, published),
        "source": SOURCES,
        "collectives": overlap,
    }


def _tpu(r: Row) -> str:
    """The TPU generation `r` was compiled for (`"v5e"` where none is named)."""
    return er.internal.slice_generation(r.target) or "v5e"


def _held(runs: list[Row], est: dict[str, float], each: dict[str, float]) -> dict:
    """How an overlap model's estimates `est` (and published over them,
    `each`) hold against `runs`: how many, their ranking, their spread."""
    return {
        "runs": len(runs),
        "spearman": _targets.spearman(
            [est[r.config] for r in runs], [r.published_mfu for r in runs]
        ),
        "most_off": _most_off([each[r.config] for r in runs]),
    }


def _most_off(ratios: list[float]) -> float | None:
    """How far the furthest of `ratios` is from their median."""
    if not ratios:
        return None
    mid = statistics.median(ratios)
    return max(abs(x / mid - 1) for x in ratios)


def _parser() -> argparse.ArgumentParser:
    return _cli.parser(__doc__, presets=list(CONFIGS), repeats=None, target=False)


def _problem(args: argparse.Namespace) -> str | None:
    if args.quick and args.preset:
        return (
            f"argument --preset: --quick measures its own config, {', '.join(QUICK)}:"
            " leave out --preset or --quick."
        )
    configs = QUICK if args.quick else CONFIGS
    depths = {f"--preset {n}": dims(c).layers for n, c in configs.items()}
    return _cli.depth_problem(args.checkpoint, depths)


def main(argv: list[str] | None = None) -> dict:
    args = _cli.parse_args(_parser(), argv, "maxtext_mfu", check=_problem)
    configs = QUICK if args.quick else CONFIGS
    names = args.preset or list(configs)
    console, t0 = _console.Console(), time.perf_counter()
    rows = []
    for name in names:
        c = configs[name]
        for spec in args.checkpoint or [c.checkpoint]:
            console.print(f"[bold]{name}[/] ({describe(c)}), {spec}, {c.target} ...")
            rows.append(measure(name, c, spec))
            r = rows[-1]
            console.print(
                f"    roofline {r.roofline_s:.3g} s (estimate), predicted MFU "
                f"{_format.fmt_pct(r.predicted_mfu)}, published "
                f"{_format.fmt_pct(r.published_mfu)}; compiled in {r.compile_s:.0f} s"
            )
    topology = ", ".join(dict.fromkeys(configs[n].target for n in names))
    data = {
        "meta": _results.meta(
            args,
            seconds=time.perf_counter() - t0,
            target=topology,
            source=SOURCES,
        ),
        "presets": {
            n: {
                "describe": describe(configs[n]),
                "dims": dims(configs[n])._asdict(),
                **configs[n]._asdict(),
                "topology": configs[n].target,
            }
            for n in names
        },
        "rows": [r._asdict() for r in rows],
        "factor": factor(rows),
    }
    stem = "maxtext_mfu" + "_quick" * args.quick
    return _ending.finish(args, console, data, stem=stem, plot=None, show=show)


C = _table.Column


def _seconds(s: float | None) -> str:
    return "n/a" if s is None else f"{s:.3g} s"


def _flops(r: Row) -> str:
    return _format.fmt_flops(r.model_flops_per_chip)


COLUMNS: list[_table.Column[Row]] = [
    C("config", lambda r: r.config),
    C("checkpoint", lambda r: r.checkpoint, code=True),
    C(
        "FLOPs/chip",
        _flops,
        "model FLOPs of one step (6 x params x tokens + causal attention in "
        "full: the published MFU's count, no recomputation)",
    ),
    C("roofline", lambda r: f"{r.roofline_s:.3g} s", "its estimate of the step"),
    C(
        "MaxText's step",
        lambda r: (
            "n/a" if r.published_step_s is None else f"{r.published_step_s:.3g} s"
        ),
        "the time MaxText's published MFU implies for these FLOPs",
    ),
    C(
        "est. MFU",
        lambda r: _format.fmt_pct(r.predicted_mfu),
        "FLOPs/chip over roofline x 197 TFLOP/s",
    ),
    C(
        "est. HFU",
        lambda r: _format.fmt_pct(r.predicted_hfu),
        "the same with the FLOPs executed (recomputation included)",
    ),
    C("MaxText MFU", lambda r: _format.fmt_pct(r.published_mfu)),
    C(
        "ratio",
        lambda r: "n/a" if r.ratio is None else f"{r.ratio:.2f}",
        "MaxText's measured MFU / est. MFU",
    ),
    C(
        "sent/chip",
        lambda r: _format.fmt_bytes(r.collective_bytes, 1),
        "bytes each chip sends per step in collectives (compiled, loops counted)",
    ),
    C(
        "to slices",
        lambda r: _format.fmt_bytes(r.network_bytes, 1),
        "bytes each chip sends other slices per step, over the DCN",
    ),
    C(
        "collectives",
        lambda r: _seconds(r.collective_s),
        "their time at one direction of the chip's ICI bandwidth, and its share "
        "of the DCN's (an estimate)",
    ),
    C(
        "est. MFU, serial",
        lambda r: _format.fmt_pct(r.serial_mfu),
        "FLOPs/chip over (roofline + collectives) x 197 TFLOP/s",
    ),
    C("temp/chip", lambda r: _format.fmt_bytes(r.temp_bytes, 1)),
    C("fits", lambda r: "yes" if r.fits else "no"),
]
"""The table, on the console (with the legend of the columns shown) and in
report.py."""


def show(console: _console.Console, data: dict, where: str) -> None:
    rows = _table.read_all(Row, data["rows"])
    where = f"TPU {data['meta']['target']} per chip, compiled, not run"
    title = f"MaxText's v5e runs, roofline [{where}]"
    console.print(_table.legend(_table.show(console, title, COLUMNS, rows)))
    for n, p in data["presets"].items():
        console.print(f"  {n}: {p['describe']}, {p['topology']}")
    f = data["factor"]
    if f["value"] is not None:
        console.print(
            f"Roofline times are estimates; MaxText's measured v5e runs reach "
            f"{f['value']:.2f} of the roofline's MFU (the median of "
            f"{len(f['ratios'])}: "
            + ", ".join(f"{n} {x:.2f}" for n, x in f["ratios"].items())
            + ")."
        )
    if f.get("spearman") is not None:
        console.print(
            f"Ranked by MFU, the roofline against the runs: Spearman "
            f"{f['spearman']:.2f} (the roofline has no term for the chips' "
            "collectives; it is not fitted to these runs)."
        )
    for model, m in f.get("collectives", {}).items():
        rho = "n/a" if m["spearman"] is None else f"{m['spearman']:.2f}"
        console.print(
            f"With the collectives, {model}: Spearman {rho}; "
            f"published / estimated MFU "
            + ", ".join(f"{n} {x:.2f}" for n, x in m["ratios"].items())
            + f" (median {m['median']:.2f}, the furthest {m['most_off']:.0%} from it)."
        )


def report(data: dict) -> str:
    """report.py's section: the configs, the table."""
    rows = _table.read_all(Row, data["rows"])
    return (
        _table.presets_markdown(data, topology=True)
        + "\n\n"
        + (_table.markdown(COLUMNS, rows))
    )


if __name__ == "__main__":
    main()
