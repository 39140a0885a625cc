"""Presets and peers: what the benchmarks measure, as types.

A preset knows how to build its zoo model, its batch and its loss, which
checkpoints and peers to compare, and how much one step processes. A peer is a
value: who wrote it (`impl`), its own label, the checkpoints of ours it is
compared with, and how to build it (`make(preset, model) -> (fn, params)`).

Each peer computes the same function as the zoo model, on the same weights (taken
from the zoo model's arrays), so its loss equals ours up to float rounding:

- `handwritten_transformer`: the transformer written as plain functions, one
  example at a time (vmapped over the batch, like the zoo), its blocks applied
  with `lax.scan(jax.checkpoint(block, policy=...))`;
- `flax_transformer`: the same, as Flax linen modules, batch-major (the way a
  Flax user writes it), blocks stacked with `nn.scan(nn.remat(Block, policy=...))`;
- `treeverse_chain`: the ResidualChain with `equinox.internal.scan(...,
  kind="checkpointed", checkpoints=c)` (online treeverse);
- `nested_scan_chain`: the ResidualChain as a 2-level nested `lax.scan`, the
  outer body under `jax.checkpoint` (the √D schedule by hand);
- `plain_scan_chain`: the ResidualChain as one batch-major `lax.scan`.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import eqx_remat as er
import zoo


@dataclasses.dataclass(frozen=True)
class Peer:
    """Another implementation of a preset's model, measured beside ours."""

    impl: str  # whose: "hand-written", "flax", "eqxi.scan"
    checkpoint: str  # its own label, e.g. "dots", "treeverse(10)"
    ours: tuple[str, ...]  # the labels of our checkpoints it is compared with
    make: Callable[[Any, Any], tuple[Callable, Any]]


# --------------------------------------------------------------------------------------
# Presets.


@dataclasses.dataclass(frozen=True)
class Preset:
    """A zoo model, its size and batch. `fsdp`: shard the parameters over the
    devices (`zoo.shard(..., fsdp=True)`); otherwise they are replicated (data
    parallel). The batch is split over the devices whenever they divide it."""

    batch: int
    # This preset's own checkpoints, instead of its class's lists.
    specs: tuple[str, ...] = dataclasses.field(default=(), kw_only=True)
    # `batch` is per device: the step's batch is `batch` x the number of devices.
    per_device: bool = dataclasses.field(default=False, kw_only=True)

    CHECKPOINTS: ClassVar[tuple[str, ...]] = ()  # the CPU sweep
    QUICK: ClassVar[tuple[str, ...]] = ("None",)
    ACCELERATOR: ClassVar[tuple[str, ...]] = ()  # added on a TPU / GPU / v5e AOT

    @property
    def depth(self) -> int:
        raise NotImplementedError

    @property
    def fsdp(self) -> bool:
        return False

    def make(self, checkpoint: er.Checkpoint, key: jax.Array) -> Any:
        raise NotImplementedError

    def build(self, checkpoint: er.Checkpoint = None, *, abstract: bool = False):
        """The zoo model with `checkpoint`; `abstract`: only shapes."""
        make = functools.partial(self.make, checkpoint, jax.random.key(0))
        return eqx.filter_eval_shape(make) if abstract else make()

    def inputs(self, *, abstract: bool = False) -> Any:
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

    def peers(self, *, quick: bool) -> tuple[Peer, ...]:
        return ()

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
        leaves = jax.tree.leaves(eqx.filter(model, is_arraylike))
        return sum(x.size * x.dtype.itemsize for x in leaves) // self.depth


@dataclasses.dataclass(frozen=True)
class TransformerPreset(Preset):
    vocab: int = 256
    seq: int = 128
    d_model: int = 128
    heads: int = 4
    layers: int = 8
    dtype: str = "float32"
    shard_params: bool = False

    CHECKPOINTS = (
        "None",
        "everything",
        "dots",
        "dots_no_batch",
        "nothing",
        "every(2)",
        "every(2, dots)",
        "nested(2)",
        "recursive()",
        "binomial(3)",
    )
    QUICK = ("None", "dots")
    ACCELERATOR = ("offload_dots_no_batch",)
    PEER_POLICIES: ClassVar[tuple[str, ...]] = (
        "None",
        "everything",
        "dots",
        "dots_no_batch",
        "nothing",
    )

    @property
    def depth(self) -> int:
        return self.layers

    @property
    def fsdp(self) -> bool:
        return self.shard_params

    def describe(self) -> str:
        return (
            f"zoo.Transformer vocab {self.vocab}, d_model {self.d_model}, "
            f"{self.heads} heads, {self.layers} layers, seq {self.seq}, "
            f"batch {self.batch}, {self.dtype}"
            + (", FSDP" if self.shard_params else "")
        )

    def make(self, checkpoint, key):
        return zoo.Transformer(
            self.vocab,
            self.seq,
            self.d_model,
            self.heads,
            self.layers,
            dtype=jnp.dtype(self.dtype),
            checkpoint=checkpoint,
            key=key,
        )

    def inputs(self, *, abstract=False):
        shape = (self.batch, self.seq)
        if abstract:
            return jax.ShapeDtypeStruct(shape, jnp.int32)
        return jax.random.randint(jax.random.key(1), shape, 0, self.vocab, jnp.int32)

    def loss(self, model, tokens):
        return cross_entropy(jax.vmap(model)(tokens), tokens)

    def peers(self, *, quick):
        pols = ("dots",) if quick else self.PEER_POLICIES
        return tuple(
            Peer(
                impl,
                spec,
                (spec,),
                functools.partial(make, checkpoint=None if spec == "None" else spec),
            )
            for impl, make in (
                ("hand-written", handwritten_transformer),
                ("flax", flax_transformer),
            )
            for spec in pols
        )

    def per_step(self):
        return "tokens_per_s", self.batch * self.seq


@dataclasses.dataclass(frozen=True)
class ChainPreset(Preset):
    width: int = 32
    layers: int = 1024
    treeverse: tuple[int, ...] = ()  # slots to compare binomial with (default ⌈log₂D⌉)
    vmap: bool = True  # False: one example, no jax.vmap (batch must be 1)

    CHECKPOINTS = (
        "None",
        "nothing",
        "every(sqrt)",
        "nested(2)",
        "nested(3)",
        "recursive()",
        "binomial(log2)",
    )
    QUICK = ("None", "recursive()", "binomial(log2)")

    @property
    def depth(self) -> int:
        return self.layers

    def describe(self) -> str:
        how = "vmapped" if self.vmap else "one example, no vmap"
        return (
            f"zoo.ResidualChain width {self.width}, depth {self.layers}, "
            f"batch {self.batch} ({how}), float32"
        )

    def make(self, checkpoint, key):
        return zoo.ResidualChain(
            self.width, self.layers, checkpoint=checkpoint, key=key
        )

    def inputs(self, *, abstract=False):
        shape = (self.batch, self.width)
        if abstract:
            return jax.ShapeDtypeStruct(shape, jnp.float32)
        return jax.random.normal(jax.random.key(1), shape, jnp.float32)

    def loss(self, model, x):
        if self.vmap:
            return super().loss(model, x)
        return jnp.mean(model(x[0]) ** 2)

    def peers(self, *, quick):
        if not self.vmap:
            return ()
        log2 = max(1, math.ceil(math.log2(max(2, self.layers))))
        outer, inner = nested_split(self.layers)
        return (
            Peer("hand-written", "None", ("None",), plain_scan_chain),
            Peer(
                "hand-written",
                f"nested-scan({outer}x{inner})",
                ("nested(2)",),
                nested_scan_chain,
            ),
        ) + tuple(
            Peer(
                "eqxi.scan",
                f"treeverse({s})",
                ("recursive()", f"binomial({s})"),
                functools.partial(treeverse_chain, checkpoints=s),
            )
            for s in (self.treeverse or (log2,))
        )


@dataclasses.dataclass(frozen=True)
class MLPPreset(Preset):
    size: int = 64
    width: int = 256
    layers: int = 32

    CHECKPOINTS = (
        "None",
        "dots",
        "nothing",
        "every(sqrt)",
        "nested(2)",
        "recursive()",
        "binomial(log2)",
    )
    QUICK = ("None", "recursive()")

    @property
    def depth(self) -> int:
        return self.layers

    def describe(self) -> str:
        return (
            f"zoo.MLP {self.size} -> {self.width} x {self.layers} -> {self.size}, "
            f"batch {self.batch}, float32"
        )

    def make(self, checkpoint, key):
        return zoo.MLP(
            self.size,
            self.size,
            self.width,
            self.layers,
            checkpoint=checkpoint,
            key=key,
        )

    def inputs(self, *, abstract=False):
        shape = (self.batch, self.size)
        if abstract:
            return jax.ShapeDtypeStruct(shape, jnp.float32)
        return jax.random.normal(jax.random.key(1), shape, jnp.float32)


# Every schedule and policy, for the parameter-dominated presets.
ALL = (
    "None",
    "dots",
    "nothing",
    "every(4)",
    "every(sqrt)",
    "nested(2)",
    "nested(3)",
    "recursive()",
    "binomial(log2)",
)
_V5E = (
    "None",
    "dots",
    "dots_no_batch",
    "nothing",
    "every(2)",
    "nested(2)",
    "recursive()",
)


def seed(
    batch: int = 4, d_model: int = 2048, layers: int = 24, seq: int = 2048, **kw: Any
) -> TransformerPreset:
    """The seed claim's transformer: bf16, vocab 32000, head dim 128, FSDP;
    `batch` per device (32 on a v5e-8)."""
    return TransformerPreset(
        batch,
        32000,
        seq,
        d_model,
        d_model // 128,
        layers,
        "bfloat16",
        True,
        per_device=True,
        **kw,
    )


PRESETS: dict[str, Preset] = {
    # The default CPU sweep: small enough to compile and run ~50 variants in a
    # few minutes on 2 cores, big enough that the residuals dominate memory.
    "transformer-s": TransformerPreset(4),
    "chain-s": ChainPreset(256),
    "mlp-s": MLPPreset(128),
    # Parameters dominate (16 MiB of weights, 4 KiB carries): every schedule
    # should stay within None's temp + one or two layers' parameters.
    "chain-params": ChainPreset(2, 512, 16, specs=ALL),
    "chain-params-novmap": ChainPreset(1, 512, 16, vmap=False, specs=ALL),
    # Heavier CPU presets.
    "transformer-m": TransformerPreset(8, 1024, 256, 256, 8, 12),
    "chain-m": ChainPreset(256, 128),
    # binomial(s) against treeverse with s checkpoints, 2 MiB carries.
    "chain-bvt": ChainPreset(4096, 128, 1024, treeverse=(4, 10, 32)),
    # For --target v5e: per-chip memory of models that leave VMEM.
    "transformer-v5e": TransformerPreset(8, 32000, 2048, 1024, 8, 16, "bfloat16"),
    # Activations dominate (batch per chip / width = 4), as on the CPU presets ...
    "chain-v5e": ChainPreset(4096, 256),
    # ... and parameters dominate (1/16): 4 GiB of weights, 256 KiB carries.
    "chain-v5e-params": ChainPreset(256, 1024),
    # Real runs on an accelerator, per 16 GiB v5e chip (FSDP, bf16, batch per
    # device): one where None fits (AOT: 13 GiB temp per chip), ...
    "v5e-fits": seed(2, d_model=1024, layers=16, specs=_V5E),
    # ... and the seed claim's own (batch 32 on a v5e-8): only checkpointing fits.
    "v5e-tight": seed(4, specs=(*_V5E, "offload_dots_no_batch")),
    # End-to-end smoke test (--quick).
    "transformer-tiny": TransformerPreset(2, 64, 16, 32, 2, 2),
    "chain-tiny": ChainPreset(2, 8, 16),
    "chain-params-tiny": ChainPreset(2, 64, 8, specs=ALL),
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


def is_arraylike(x: Any) -> bool:
    """Arrays and `jax.ShapeDtypeStruct`s (abstract models): what is
    differentiated."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def ours(preset: Preset, model: Any, checkpoint: er.Checkpoint) -> tuple[Callable, Any]:
    """`(fn, params)`: `fn(params, batch) = value_and_grad(loss)` of the zoo model
    with `checkpoint`, differentiated with respect to its arrays `params`."""
    params, static = eqx.partition(er.set_checkpoint(model, checkpoint), is_arraylike)

    def loss(p, b):
        return preset.loss(eqx.combine(p, static), b)

    return jax.value_and_grad(loss), params


# --------------------------------------------------------------------------------------
# Transformer peers. The math is the zoo's `_Block`, restated.


def _layer_norm(x, weight, bias, eps=1e-5):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.maximum(0.0, jnp.var(x32, axis=-1, keepdims=True))
    out = (x32 - mean) * lax.rsqrt(var + eps)
    return (weight.astype(jnp.float32) * out + bias.astype(jnp.float32)).astype(x.dtype)


def _linear(x, weight, bias=None):
    y = x @ weight.astype(x.dtype)
    if bias is not None:
        y = y + bias.astype(x.dtype)[None, :]
    return y


def _attention(qkv, seq, heads, head_dim, dtype):
    """Causal attention on a `(seq, 3 d_model)` projection (one example)."""
    q, k, v = jnp.split(qkv.reshape(seq, 3, heads, head_dim), 3, 1)
    q, k, v = q[:, 0], k[:, 0], v[:, 0]
    scores = jnp.einsum("qhd,khd->hqk", q, k).astype(jnp.float32)
    scores = scores / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, heads * head_dim)


def transformer_arrays(model: Any) -> dict[str, Any]:
    """The zoo Transformer's weights as a plain dict of arrays (layers stacked)."""
    b = model.blocks
    return {
        "tok": model.token_embedding.weight,
        "pos": model.position_embedding.weight,
        "blocks": {
            "ln1_w": b.attention_norm.weight,
            "ln1_b": b.attention_norm.bias,
            "qkv_w": b.qkv.weight,
            "qkv_b": b.qkv.bias,
            "out_w": b.out.weight,
            "out_b": b.out.bias,
            "ln2_w": b.mlp_norm.weight,
            "ln2_b": b.mlp_norm.bias,
            "in_w": b.mlp_in.weight,
            "in_b": b.mlp_in.bias,
            "mlp_w": b.mlp_out.weight,
            "mlp_b": b.mlp_out.bias,
        },
        "lnf_w": model.final_norm.weight,
        "lnf_b": model.final_norm.bias,
        "head_w": model.head.weight,
    }


def handwritten_transformer(
    preset: "TransformerPreset", model: Any, checkpoint: str | None
) -> tuple[Callable, Any]:
    """`(fn, arrays)`: value_and_grad of the loss of the transformer written by
    hand: one example at a time, vmapped, blocks applied with
    `lax.scan(jax.checkpoint(block, policy=er.policy(checkpoint),
    prevent_cse=False))` (no `jax.checkpoint` for `None`)."""
    heads, dtype = preset.heads, jnp.dtype(preset.dtype)
    pol = er.policy(checkpoint)

    def block(x, p):
        seq, d = x.shape
        x = checkpoint_name(x, "layer_input")
        h = _layer_norm(x, p["ln1_w"], p["ln1_b"])
        qkv = checkpoint_name(_linear(h, p["qkv_w"], p["qkv_b"]), "qkv_proj")
        ctx = _attention(qkv, seq, heads, d // heads, x.dtype)
        ctx = checkpoint_name(ctx, "attention_context")
        x = x + checkpoint_name(_linear(ctx, p["out_w"], p["out_b"]), "out_proj")
        h = _layer_norm(x, p["ln2_w"], p["ln2_b"])
        h = checkpoint_name(_linear(h, p["in_w"], p["in_b"]), "mlp_hidden")
        m = _linear(jax.nn.gelu(h), p["mlp_w"], p["mlp_b"])
        return x + checkpoint_name(m, "mlp_out"), None

    if pol is not None:
        block = jax.checkpoint(block, policy=pol, prevent_cse=False)

    def forward(a, tokens):
        seq = tokens.shape[0]
        x = (a["tok"][tokens] + a["pos"][:seq]).astype(dtype)
        x = lax.scan(block, x, a["blocks"])[0]
        x = _layer_norm(x, a["lnf_w"], a["lnf_b"])
        return _linear(x, a["head_w"]).astype(jnp.float32)

    def loss(a, tokens):
        return cross_entropy(jax.vmap(forward, in_axes=(None, 0))(a, tokens), tokens)

    return jax.value_and_grad(loss), transformer_arrays(model)


def _flax_lm(preset: "TransformerPreset", d_ff: int, pol: Any) -> Any:
    """The transformer as Flax linen modules, batch-major, blocks stacked with
    `nn.scan(nn.remat(Block, policy=pol, prevent_cse=False))`."""
    import flax.linen as nn

    dtype, heads = jnp.dtype(preset.dtype), preset.heads

    def norm(name):
        return nn.LayerNorm(
            epsilon=1e-5, dtype=dtype, use_fast_variance=False, name=name
        )

    def dense(n, name, tag, x):
        return checkpoint_name(nn.Dense(n, dtype=dtype, name=name)(x), tag)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            b, seq, d = x.shape
            x = checkpoint_name(x, "layer_input")
            qkv = dense(3 * d, "qkv", "qkv_proj", norm("ln1")(x))
            ctx = jax.vmap(lambda t: _attention(t, seq, heads, d // heads, dtype))(qkv)
            ctx = checkpoint_name(ctx, "attention_context")
            x = x + dense(d, "out", "out_proj", ctx)
            h = dense(d_ff, "mlp_in", "mlp_hidden", norm("ln2")(x))
            m = nn.Dense(d, dtype=dtype, name="mlp_out")(jax.nn.gelu(h))
            return x + checkpoint_name(m, "mlp_out"), None

    block = Block if pol is None else nn.remat(Block, policy=pol, prevent_cse=False)
    stack = nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=preset.layers,
    )

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            init = nn.initializers.zeros
            tok = self.param("tok", init, (preset.vocab, preset.d_model))
            pos = self.param("pos", init, (preset.seq, preset.d_model))
            x = (tok[tokens] + pos[None, : tokens.shape[1]]).astype(dtype)
            x, _ = stack(name="blocks")(x, None)
            head = nn.Dense(preset.vocab, use_bias=False, dtype=dtype, name="head")
            return head(norm("lnf")(x)).astype(jnp.float32)

    return LM()


def _flax_params(a: dict[str, Any]) -> dict[str, Any]:
    """`transformer_arrays` in Flax's tree (the kernels are `(in, out)` in both)."""
    bl = a["blocks"]

    def dense(w, b):
        return {"kernel": bl[w], "bias": bl[b]}

    return {
        "tok": a["tok"],
        "pos": a["pos"],
        "blocks": {
            "ln1": {"scale": bl["ln1_w"], "bias": bl["ln1_b"]},
            "qkv": dense("qkv_w", "qkv_b"),
            "out": dense("out_w", "out_b"),
            "ln2": {"scale": bl["ln2_w"], "bias": bl["ln2_b"]},
            "mlp_in": dense("in_w", "in_b"),
            "mlp_out": dense("mlp_w", "mlp_b"),
        },
        "lnf": {"scale": a["lnf_w"], "bias": a["lnf_b"]},
        "head": {"kernel": a["head_w"]},
    }


def flax_transformer(
    preset: "TransformerPreset", model: Any, checkpoint: str | None
) -> tuple[Callable, Any]:
    """`(fn, params)`: value_and_grad of the loss of the transformer in Flax linen
    (`_flax_lm`), with the zoo model's weights."""
    lm = _flax_lm(preset, model.d_ff, er.policy(checkpoint))
    params = _flax_params(transformer_arrays(model))
    expected = jax.eval_shape(
        lm.init, jax.random.key(0), jnp.zeros((1, preset.seq), jnp.int32)
    )["params"]
    if jax.tree.structure(expected) != jax.tree.structure(params):
        raise AssertionError(
            f"Flax params do not match: {jax.tree.structure(expected)} vs "
            f"{jax.tree.structure(params)}"
        )

    def loss(p, tokens):
        return cross_entropy(lm.apply({"params": p}, tokens), tokens)

    return jax.value_and_grad(loss), params


# --------------------------------------------------------------------------------------
# ResidualChain peers (batch-major, like a user would write them).


def chain_arrays(model: Any) -> tuple[jax.Array, jax.Array]:
    return model.layers.linear.weight, model.layers.linear.bias


def _chain_layer(depth: int):
    step = 1.0 / depth

    def layer(x, p):
        w, b = p  # `equinox.nn.Linear`'s: the weight is (out, in)
        return x + step * jnp.tanh(x @ w.T + b[None, :]), None

    return layer


def _chain_loss(run: Callable) -> Callable:
    return jax.value_and_grad(lambda p, x: jnp.mean(run(p, x) ** 2))


def plain_scan_chain(preset: "ChainPreset", model: Any) -> tuple[Callable, Any]:
    """One batch-major `lax.scan`, no checkpointing."""
    layer = _chain_layer(preset.depth)
    return _chain_loss(lambda p, x: lax.scan(layer, x, p)[0]), chain_arrays(model)


def treeverse_chain(
    preset: "ChainPreset", model: Any, checkpoints: int
) -> tuple[Callable, Any]:
    """`equinox.internal.scan(kind="checkpointed", checkpoints=checkpoints)`:
    online treeverse with that many stored carries."""
    layer = _chain_layer(preset.depth)

    def run(p, x):
        return eqxi.scan(layer, x, p, kind="checkpointed", checkpoints=checkpoints)[0]

    return _chain_loss(run), chain_arrays(model)


def nested_split(depth: int) -> tuple[int, int]:
    """`(outer, inner)` with `outer * inner == depth`, both as close to √depth as
    divisors allow (the √D split of a 2-level nested scan)."""
    inner = max(d for d in range(1, math.isqrt(depth) + 1) if depth % d == 0)
    return depth // inner, inner


def nested_scan_chain(preset: "ChainPreset", model: Any) -> tuple[Callable, Any]:
    """A 2-level nested `lax.scan`: `outer` segments of `inner` layers, each
    segment under `jax.checkpoint` (the √D schedule written by hand)."""
    outer, inner = nested_split(preset.depth)
    layer = _chain_layer(preset.depth)

    def segment(x, p):
        return lax.scan(layer, x, p)[0], None

    segment = jax.checkpoint(segment, prevent_cse=False)

    def run(p, x):
        p = jax.tree.map(lambda a: a.reshape(outer, inner, *a.shape[1:]), p)
        return lax.scan(segment, x, p)[0]

    return _chain_loss(run), chain_arrays(model)
