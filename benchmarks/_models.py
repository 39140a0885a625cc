"""Presets: what the benchmarks measure. A preset builds its zoo model, batch
and loss, names the checkpoints to compare and how much one step processes;
`PRESETS` holds them by name (peers: `_peers.py`).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import eqx_remat as er
import zoo
from eqx_remat.internal import is_array_like


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset:
    """A zoo model, its size and batch (split over the devices where they divide
    it; the parameters replicated unless `fsdp`)."""

    batch: int
    layers: int  # the depth of the stack that checkpoints apply to
    specs: tuple[str, ...] = ()  # its own checkpoints, instead of its class's
    per_device: bool = False  # `batch` is per device

    CHECKPOINTS: ClassVar[tuple[str, ...]] = ()  # the CPU sweep
    QUICK: ClassVar[tuple[str, ...]] = ("None",)
    ACCELERATOR: ClassVar[tuple[str, ...]] = ()  # added on a TPU / GPU / v5e AOT

    @property
    def depth(self) -> int:
        return self.layers

    def stack_depths(self) -> dict[str, int]:
        """The depth of each stack a checkpoint applies to, by the path of its
        `checkpoint` field in the model (one stack: `{"": depth}`)."""
        return {"": self.depth}

    @property
    def fsdp(self) -> bool:
        """Shard the parameters over the devices (`zoo.shard(..., fsdp=True)`)."""
        return False

    def make(self, checkpoint: er.Checkpoint, key: jax.Array) -> Any:
        """The zoo model."""
        raise NotImplementedError

    def build(self, *, abstract: bool = False):
        """The zoo model, not checkpointed; `abstract`: only shapes."""
        make = functools.partial(self.make, None, jax.random.key(0))
        return eqx.filter_eval_shape(make) if abstract else make()

    def inputs(self, *, abstract: bool = False) -> Any:
        """The batch (fixed key), or its `ShapeDtypeStruct`s."""
        raise NotImplementedError

    def loss(self, model: Any, batch: jax.Array) -> jax.Array:
        """Mean loss of a batch, the model applied per example under `jax.vmap`."""
        return jnp.mean(jax.vmap(model)(batch) ** 2)

    def checkpoints(self, *, quick: bool, accelerator: bool) -> tuple[str, ...]:
        if self.specs:
            return self.specs
        if quick:
            return self.QUICK
        return self.CHECKPOINTS + (self.ACCELERATOR if accelerator else ())

    def on(self, devices: int) -> "Preset":
        """This preset on `devices` devices (scales a per-device batch)."""
        if not self.per_device:
            return self
        return dataclasses.replace(self, batch=self.batch * devices, per_device=False)

    def per_step(self) -> tuple[str, int]:
        """(`"examples_per_s"` or `"tokens_per_s"`, how many one step processes)."""
        return "examples_per_s", self.batch

    def layer_param_bytes(self) -> int:
        model = self.build(abstract=True)
        leaves = jax.tree.leaves(eqx.filter(model, is_array_like))
        return sum(x.size * x.dtype.itemsize for x in leaves) // self.depth


def _normal(shape: tuple[int, ...], *, abstract: bool) -> Any:
    if abstract:
        return jax.ShapeDtypeStruct(shape, jnp.float32)
    return jax.random.normal(jax.random.key(1), shape, jnp.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerPreset(Preset):
    layers: int = 8
    vocab: int = 256
    seq: int = 128
    d_model: int = 128
    heads: int = 4
    dtype: str = "float32"
    shard_params: bool = False
    # "gpt2": zoo.Transformer as it is; "llama": zoo.Transformer.llama (RMSNorm,
    # rotary positions, SwiGLU, grouped-query attention).
    block: str = "gpt2"
    attention: str = "dot_product"  # or "flash": the Pallas TPU kernel (v5e)
    d_ff: int | None = None  # the block's default when None
    kv_heads: int | None = None  # "llama": the block's default when None

    CHECKPOINTS = ("None", "everything", "dots", "dots_no_batch", "nothing")
    CHECKPOINTS += ("every(2)", "every(2, dots)", "nested(2)", "recursive()")
    CHECKPOINTS += ("binomial(3)",)
    QUICK = ("None", "dots")
    ACCELERATOR = ("offload_dots_no_batch",)

    @property
    def fsdp(self) -> bool:
        return self.shard_params

    def describe(self) -> str:
        kind = "zoo.Transformer" + (".llama" if self.block == "llama" else "")
        attention = self.attention != "dot_product"
        return (
            f"{kind} vocab {self.vocab}, d_model {self.d_model}, {self.heads} heads, "
            f"{self.layers} layers, seq {self.seq}, batch {self.batch}, {self.dtype}"
            + (f", {self.attention} attention" if attention else "")
            + (", FSDP" if self.shard_params else "")
        )

    def make(self, checkpoint, key):
        llama = self.block == "llama"
        extra = {"d_ff": self.d_ff}
        if llama:
            extra |= {"attention": self.attention, "num_kv_heads": self.kv_heads}
        make = zoo.Transformer.llama if llama else zoo.Transformer
        return make(
            vocab_size=self.vocab,
            max_len=self.seq,
            d_model=self.d_model,
            num_heads=self.heads,
            num_layers=self.layers,
            dtype=jnp.dtype(self.dtype),
            checkpoint=checkpoint,
            key=key,
            **{k: v for k, v in extra.items() if v is not None},
        )

    def inputs(self, *, abstract=False):
        shape = (self.batch, self.seq)
        if abstract:
            return jax.ShapeDtypeStruct(shape, jnp.int32)
        return jax.random.randint(jax.random.key(1), shape, 0, self.vocab, jnp.int32)

    def loss(self, model, tokens):
        # The flash kernel runs per chip under `jax.shard_map`: the batch axis of
        # the vmap is the mesh's "data" axis.
        axis = "data" if self.attention == "flash" else None
        return cross_entropy(jax.vmap(model, spmd_axis_name=axis)(tokens), tokens)

    def per_step(self):
        return "tokens_per_s", self.batch * self.seq


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChainPreset(Preset):
    layers: int = 1024
    width: int = 32
    treeverse: tuple[int, ...] = ()  # slots to compare binomial with (default ⌈log₂D⌉)
    vmap: bool = True  # False: one example, no jax.vmap (batch must be 1)

    CHECKPOINTS = ("None", "nothing", "every(sqrt)", "nested(2)", "nested(3)")
    CHECKPOINTS += ("recursive()", "binomial(log2)")
    QUICK = ("None", "recursive()", "binomial(log2)")

    def describe(self) -> str:
        how = "vmapped" if self.vmap else "one example, no vmap"
        return (
            f"zoo.ResidualChain width {self.width}, depth {self.layers}, "
            f"batch {self.batch} ({how}), float32"
        )

    def make(self, checkpoint, key):
        return zoo.ResidualChain(
            width=self.width, depth=self.layers, checkpoint=checkpoint, key=key
        )

    def inputs(self, *, abstract=False):
        return _normal((self.batch, self.width), abstract=abstract)

    def loss(self, model, x):
        if self.vmap:
            return super().loss(model, x)
        return jnp.mean(model(x[0]) ** 2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPPreset(Preset):
    layers: int = 32
    size: int = 64
    width: int = 256

    CHECKPOINTS = ("None", "dots", "nothing", "every(sqrt)", "nested(2)")
    CHECKPOINTS += ("recursive()", "binomial(log2)")
    QUICK = ("None", "recursive()")

    def describe(self) -> str:
        return (
            f"zoo.MLP {self.size} -> {self.width} x {self.layers} -> {self.size}, "
            f"batch {self.batch}, float32"
        )

    def make(self, checkpoint, key):
        return zoo.MLP(
            in_size=self.size,
            out_size=self.size,
            width_size=self.width,
            depth=self.layers,
            checkpoint=checkpoint,
            key=key,
        )

    def inputs(self, *, abstract=False):
        return _normal((self.batch, self.size), abstract=abstract)


class Block(eqx.Module):
    """The block of the tutorial *Checkpoint your own Equinox model*: a
    pre-norm residual MLP, 4x wide, with the zoo's `Dense` projections
    (weights `(in, out)`) and its up projection tagged `"mlp_hidden"`, so that
    the planner has a name policy to try."""

    norm: eqx.nn.LayerNorm
    up: zoo.Dense
    down: zoo.Dense

    def __init__(self, width: int, *, key: jax.Array):
        ukey, dkey = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(width)
        self.up = zoo.Dense(width, 4 * width, key=ukey)
        self.down = zoo.Dense(4 * width, width, key=dkey)

    def __call__(self, x: jax.Array) -> jax.Array:
        # Tagged as zoo.Transformer tags it: the up projection, before the GELU.
        hidden = checkpoint_name(self.up(self.norm(x)), "mlp_hidden")
        return x + self.down(jax.nn.gelu(hidden))


class EncoderDecoder(eqx.Module):
    """Two stacks of `Block`s, each an `eqx_remat.Stacked` with its own
    `checkpoint`: an encoder into a decoder of another width and depth (the
    tutorial's model with several stacks)."""

    encoder: er.Stacked[Block]
    project: zoo.Dense
    decoder: er.Stacked[Block]

    def __init__(self, width, layers, decoder_width, decoder_layers, *, key):
        ekey, pkey, dkey = jax.random.split(key, 3)
        keys = jax.random.split(ekey, layers)
        self.encoder = er.Stacked([Block(width, key=k) for k in keys])
        self.project = zoo.Dense(width, decoder_width, key=pkey)
        keys = jax.random.split(dkey, decoder_layers)
        self.decoder = er.Stacked([Block(decoder_width, key=k) for k in keys])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.decoder(self.project(self.encoder(x)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderDecoderPreset(Preset):
    """Two stacks under one budget (`EncoderDecoder`): a checkpoint applies to
    each stack, and `plan` gives each its own. `layers` and `width` are the
    encoder's."""

    layers: int = 6
    width: int = 96
    decoder_layers: int = 3
    decoder_width: int = 288

    # Each stack's per-layer options as the planner prices them, but
    # "dots_no_batch": under `jax.vmap` these blocks' products have no batch
    # dimension, and it is "dots" (the same program). "dots" and the name
    # policy keep the same value (the up projection; `down`'s output is not
    # needed backwards): two names, one program, timed apart.
    CHECKPOINTS = ("None", "dots", "nothing", "save_names(mlp_hidden)")
    QUICK = ("None", "nothing")

    def stack_depths(self) -> dict[str, int]:
        return {
            ".encoder.checkpoint": self.layers,
            ".decoder.checkpoint": self.decoder_layers,
        }

    def describe(self) -> str:
        return (
            f"encoder {self.layers} blocks of width {self.width} -> decoder "
            f"{self.decoder_layers} of width {self.decoder_width} (the own-model "
            f"tutorial's residual MLP block, 4x wide), batch {self.batch}, float32"
        )

    def make(self, checkpoint, key):
        model = EncoderDecoder(
            self.width, self.layers, self.decoder_width, self.decoder_layers, key=key
        )
        return er.set_checkpoint(model, checkpoint)

    def inputs(self, *, abstract=False):
        return _normal((self.batch, self.width), abstract=abstract)


def seed(**changes: Any) -> TransformerPreset:
    """The seed claim's transformer, the one place it is defined: batch 32,
    seq 2048, 24 layers, d_model 2048 with head dim 128, vocab 32000, bfloat16,
    parameters sharded (FSDP), with `changes` (`TransformerPreset`'s keyword
    arguments; the heads follow `d_model`)."""
    setting = dict(batch=32, seq=2048, layers=24, d_model=2048, vocab=32000)
    setting |= dict(dtype="bfloat16", shard_params=True) | changes
    return TransformerPreset(heads=max(1, setting["d_model"] // 128), **setting)


# Every schedule and policy, for the parameter-dominated presets.
ALL = ("None", "dots", "nothing", "every(4)", "every(sqrt)", "nested(2)", "nested(3)")
ALL += ("recursive()", "binomial(log2)")
_V5E = ("None", "dots", "dots_no_batch", "nothing", "every(2)", "nested(2)")
_V5E += ("recursive()",)

PRESETS: dict[str, Preset] = {
    # The default CPU sweep: ~50 variants in minutes, residuals dominate memory.
    "transformer-s": TransformerPreset(batch=4),
    "chain-s": ChainPreset(batch=256),
    "mlp-s": MLPPreset(batch=128),
    # Parameters dominate (16 MiB of weights, 4 KiB carries).
    "chain-params": ChainPreset(batch=2, width=512, layers=16, specs=ALL),
    "chain-params-novmap": ChainPreset(
        batch=1, width=512, layers=16, vmap=False, specs=ALL
    ),
    # 2x wider, 2x longer: a FLOP-ranked planner misordered its options (#28).
    "transformer-w": TransformerPreset(batch=4, seq=256, d_model=256),
    # The loss head outweighs the blocks: logits 4 x 128 x 8192 (16 MiB in f32).
    "transformer-v": TransformerPreset(batch=4, vocab=8192),
    "transformer-m": TransformerPreset(
        batch=8, vocab=1024, seq=256, d_model=256, heads=8, layers=12
    ),
    "chain-m": ChainPreset(batch=256, width=128),
    # binomial(s) against treeverse with s checkpoints, 2 MiB carries.
    "chain-bvt": ChainPreset(batch=4096, width=128, treeverse=(4, 10, 32)),
    # --target v5e: models that leave VMEM; the seed setting, smaller, replicated.
    "transformer-v5e": seed(batch=8, d_model=1024, layers=16, shard_params=False),
    # Activations dominate (batch per chip / width = 4), as on the CPU presets ...
    "chain-v5e": ChainPreset(batch=4096, width=256),
    # ... and parameters dominate (1/16): 4 GiB of weights, 256 KiB carries.
    "chain-v5e-params": ChainPreset(batch=256, width=1024),
    # Real runs per 16 GiB v5e chip: None fits (AOT: 13 GiB temp per chip) ...
    "v5e-fits": seed(batch=2, per_device=True, d_model=1024, layers=16, specs=_V5E),
    # ... and the seed claim's own (batch 32 on a v5e-8): only checkpointing fits.
    "v5e-tight": seed(batch=4, per_device=True, specs=(*_V5E, "offload_dots_no_batch")),
    # The planner's seed setting (issue 22): Llama block, flash attention.
    "seed-llama": seed(
        block="llama",
        attention="flash",
        specs=("None", "dots", "dots_no_batch", "nothing", "offload_dots_no_batch"),
    ),
    # MaxText's 16B model as MaxText/configs/v5e/16b.sh trains it (remat_policy
    # full, per_device_batch_size 6, seq 2048, flash attention, llama2 block):
    # MaxText's 64 heads of 128 are 32 here (the zoo's attention is d_model wide).
    "maxtext-16b": seed(
        block="llama",
        attention="flash",
        d_model=4096,
        layers=32,
        d_ff=28672,
        kv_heads=32,
        batch=6,
        per_device=True,
        specs=("nothing",),
    ),
    # ... and its 32B and 64B (configs/v5e/32b.sh, 64b.sh: global_parameter_scale
    # 32 and 64 over base.yml's dims, per_device_batch_size 4 and 2, remat
    # full): d_model 8192 = MaxText's 64 heads of 128, MLP 28672, 32 and 64 layers.
    **{
        f"maxtext-{size}b": seed(
            block="llama",
            attention="flash",
            d_model=8192,
            layers=layers,
            d_ff=28672,
            kv_heads=64,
            batch=batch,
            per_device=True,
            specs=("nothing",),
        )
        for size, layers, batch in ((32, 32, 4), (64, 64, 2))
    },
    # Meshes on 8 host devices (mesh_sweep.py): weights (4.5 MiB) outweigh a
    # layer's activations, so what the chips send each other shows.
    "transformer-mesh": TransformerPreset(
        batch=16, vocab=1024, seq=64, d_model=256, heads=4, layers=4
    ),
    # Two stacks under one budget (plan_sweep.py): a narrow, deep encoder into a
    # wide, shallow decoder; activations dominate (None: ~90 MiB, weights ~11).
    "encoder-decoder": EncoderDecoderPreset(batch=512),
    # End-to-end smoke test (--quick).
    "transformer-tiny": TransformerPreset(
        batch=2, vocab=64, seq=16, d_model=32, heads=2, layers=2
    ),
    "transformer-mesh-tiny": TransformerPreset(
        batch=8, vocab=64, seq=16, d_model=32, heads=2, layers=2
    ),
    "chain-tiny": ChainPreset(batch=2, width=8, layers=16),
    "chain-params-tiny": ChainPreset(batch=2, width=64, layers=8, specs=ALL),
    "encoder-decoder-tiny": EncoderDecoderPreset(
        batch=8, width=8, layers=4, decoder_width=24, decoder_layers=2
    ),
}

DEFAULT = ("transformer-s", "chain-s", "mlp-s", "chain-params", "chain-params-novmap")
ACCELERATOR = ("transformer-s", "chain-s", "mlp-s", "chain-params", "v5e-fits")
V5E = ("transformer-v5e", "chain-v5e", "chain-v5e-params")
QUICK = ("transformer-tiny", "chain-tiny", "chain-params-tiny")


# --------------------------------------------------------------------------------------
# Losses and our variants.


def cross_entropy(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy; `logits` `(batch, seq, vocab)`."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def ours(preset: Preset, model: Any, checkpoint: er.Checkpoint) -> tuple[Callable, Any]:
    """`(fn, params)`: `fn(params, batch) = value_and_grad(loss)` of the zoo model
    with `checkpoint`, differentiated with respect to its arrays `params`."""
    params, static = eqx.partition(er.set_checkpoint(model, checkpoint), is_array_like)

    def loss(p, b):
        return preset.loss(eqx.combine(p, static), b)

    return jax.value_and_grad(loss), params
