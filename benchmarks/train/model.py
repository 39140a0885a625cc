"""The model, the optimiser and the compiled steps: `zoo.Transformer` over bytes,
AdamW, a `TrainState` that holds everything a resumed run needs, and where its
arrays live (`Placement`)."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import eqx_remat
import zoo

from .config import VOCAB_SIZE, RunConfig, UsageError, learning_rate_schedule


class Placement(NamedTuple):
    """Where arrays live: a 1-D mesh with axis `"data"`, DP or FSDP."""

    mesh: Mesh
    fsdp: bool

    def params(self, tree):
        return zoo.shard(tree, self.mesh, fsdp=self.fsdp)

    def batch(self, tree):
        return zoo.shard_batch(tree, self.mesh)

    def batch_from(
        self, read: Callable[[slice], np.ndarray], shape: tuple[int, ...]
    ) -> jax.Array:
        """The global batch of `shape`, split over the mesh like `batch`, from
        `read(rows)`: each process reads only the rows of its own devices."""
        spec = PartitionSpec("data", *[None] * (len(shape) - 1))
        sharding = NamedSharding(self.mesh, spec)
        return jax.make_array_from_callback(shape, sharding, lambda i: read(i[0]))


def make_placement(spec: tuple[str, int | None] | None, batch: int) -> Placement | None:
    """The `Placement` of `--mesh` (`config.mesh_spec`'s value), or `None`."""
    processes = jax.process_count()
    if spec is None or (spec[1] is not None and spec[1] != jax.device_count()):
        if processes > 1:  # a process outside the mesh would have nothing to do
            given = "none" if spec is None else f"{spec[0]}:{spec[1]}"
            raise UsageError(
                f"--mesh {given}: with {processes} processes the mesh must span "
                f"all {jax.device_count()} devices. Use --mesh auto, dp or fsdp."
            )
    if spec is None:
        return None
    strategy, n = spec
    available = jax.device_count()
    if strategy == "auto":
        if available == 1:
            return None
        strategy, n = "dp", available
    n = available if n is None else n
    if n > available:
        raise UsageError(
            f"--mesh {strategy}:{n}: expected 1 to {available} devices (jax sees "
            f"{available}). On CPU, set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={n} before starting Python."
        )
    if batch % n != 0:
        raise UsageError(
            f"--mesh {strategy}:{n}: --batch must be divisible by {n} devices. "
            f"Got {batch}."
        )
    mesh = jax.make_mesh((n,), ("data",), (AxisType.Auto,), devices=jax.devices()[:n])
    return Placement(mesh, fsdp=strategy == "fsdp")


class TrainState(NamedTuple):
    """Everything a resumed run needs besides the `RunConfig`."""

    model: zoo.Transformer
    opt_state: Any
    step: jax.Array  # int32 scalar: optimiser steps taken
    key: jax.Array  # uint32 key data; the dropout key of step s is fold_in(key, s)


def make_model(c: RunConfig, key) -> zoo.Transformer:
    return zoo.Transformer(
        VOCAB_SIZE,
        c.seq,
        c.d_model,
        c.heads,
        c.layers,
        d_ff=c.d_ff,
        dropout=c.dropout,
        dtype=jnp.dtype(c.dtype),
        key=key,
    )


def decay_mask(params):
    """AdamW decays the weights of linear layers only (not embeddings, norms or
    biases)."""

    def mark(x):
        if isinstance(x, zoo.Dense):
            m = jax.tree.map(lambda _: False, x)
            return eqx.tree_at(lambda lin: lin.weight, m, True)
        return False

    is_linear = lambda x: isinstance(x, zoo.Dense)
    return jax.tree.map(mark, params, is_leaf=is_linear)


# The fields of a `RunConfig` that define its optimiser.
OPTIMISER_FIELDS = ("steps", "lr", "schedule", "warmup", "min_lr_ratio")
OPTIMISER_FIELDS += ("weight_decay", "clip")


def make_optimizer(c: RunConfig) -> optax.GradientTransformation:
    """Clipping, then AdamW on the learning-rate schedule. (Cached on the fields
    that define it: runs that differ only in others, their data or seed, get the
    same optimiser, and so reuse the compiled step.)"""
    return _optimizer(RunConfig(**{f: getattr(c, f) for f in OPTIMISER_FIELDS}))


@functools.lru_cache(maxsize=8)
def _optimizer(c: RunConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(c.clip),
        optax.adamw(
            learning_rate_schedule(c),
            b1=0.9,
            b2=0.95,
            weight_decay=c.weight_decay,
            mask=decay_mask,
        ),
    )


@eqx.filter_jit
def init_state(c: RunConfig) -> TrainState:
    """A fresh `TrainState` from `c.seed` (jitted: one compile, not one per op)."""
    model_key, dropout_key = jr.split(jr.key(c.seed))
    model = make_model(c, model_key)
    opt_state = make_optimizer(c).init(eqx.filter(model, eqx.is_array))
    return TrainState(model, opt_state, jnp.int32(0), jr.key_data(dropout_key))


def abstract_state(c: RunConfig, placement: Placement | None) -> TrainState:
    """`init_state(c)` as `jax.ShapeDtypeStruct`s with `placement`'s shardings
    (what a checkpoint is restored into)."""
    like = eqx_remat.set_checkpoint(eqx.filter_eval_shape(init_state, c), None)
    return placement.params(like) if placement is not None else like


def loss_fn(model: zoo.Transformer, tokens: jax.Array, key: jax.Array | None):
    """Mean next-byte cross-entropy (nats) of `tokens`, `(batch, seq + 1)`."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if key is None:
        logits = jax.vmap(model)(inputs)
    else:
        keys = jr.split(key, tokens.shape[0])
        logits = jax.vmap(lambda t, k: model(t, key=k))(inputs, keys)
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets
    )
    return jnp.mean(losses)


def step_fn(
    tokens_and_step: tuple[jax.Array, jax.Array],
    state: TrainState,
    optimizer: optax.GradientTransformation,
    placement: Placement | None,
) -> tuple[jax.Array, TrainState]:
    """One AdamW step on `tokens`; returns the loss before the step."""
    tokens, step = tokens_and_step
    key = jr.fold_in(jr.wrap_key_data(state.key), step)
    loss, grads = eqx.filter_value_and_grad(loss_fn)(state.model, tokens, key)
    params = eqx.filter(state.model, eqx.is_array)
    # optax computes `b1 ** count` (a Python float to an int32 power): allowed under
    # the standard dtype promotion, refused by the strict one that the tests use.
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
    model = eqx.apply_updates(state.model, updates)
    state = TrainState(model, opt_state, state.step + 1, state.key)
    if placement is not None:  # keep the parameters (and moments) where they were
        state = placement.params(state)
    return loss, state


train_step = eqx.filter_jit(step_fn, donate="all-except-first")


@eqx.filter_jit
def eval_loss(model: zoo.Transformer, tokens: jax.Array) -> jax.Array:
    return loss_fn(eqx.nn.inference_mode(model), tokens, None)


def step_flops(
    state: TrainState, tokens: Any, optimizer: optax.GradientTransformation
) -> tuple[int, int]:
    """FLOPs of one training step on the global batch `tokens` (an array or a
    `jax.ShapeDtypeStruct`): `(model, hardware)`, i.e. with `checkpoint=None` (no
    recomputation, for MFU) and with the state's own checkpoint (for HFU). Counted
    by `eqx_remat.count_flops` from the traced step; attention's score and context
    matmuls count in full (`seq x seq`), without halving for the causal mask."""

    def count(s: TrainState) -> int:
        arrays, static = eqx.partition(s, eqx.is_array)
        fn = lambda a, t: step_fn(
            (t, jnp.int32(0)), eqx.combine(a, static), optimizer, None
        )
        return int(eqx_remat.count_flops(fn, arrays, tokens))

    hardware = count(state)
    model = count(eqx_remat.set_checkpoint(state, None))
    return model, hardware
