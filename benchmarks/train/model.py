"""The model, the optimiser and the compiled steps: `zoo.Transformer` over bytes,
AdamW, the `TrainState` a resumed run needs, and where its arrays live."""

import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
from jax.sharding import AxisType, Mesh

import eqx_remat
import zoo

from .config import VOCAB_SIZE, RunConfig, UsageError, learning_rate_schedule


class Placement(NamedTuple):
    """Where arrays live: a 1-D mesh with axis `"data"`, DP or FSDP."""

    mesh: Mesh
    fsdp: bool

    def params(self, tree):
        return zoo.shard(tree, self.mesh, fsdp=self.fsdp)


def make_placement(spec: tuple[str, int | None] | None, batch: int) -> Placement | None:
    """The `Placement` of `--mesh` (`config.mesh_spec`'s value), or `None`; a
    `UsageError` for a mesh this machine cannot make."""
    available, processes = jax.device_count(), jax.process_count()
    if processes > 1 and (spec is None or spec[1] not in (None, available)):
        given = "none" if spec is None else f"{spec[0]}:{spec[1]}"
        raise UsageError(  # a process outside the mesh would have nothing to do
            f"--mesh {given}: with {processes} processes the mesh must span "
            f"all {available} devices. Use --mesh auto, dp or fsdp."
        )
    if spec is None or (spec == ("auto", None) and available == 1):
        return None
    strategy, n = ("dp", available) if spec[0] == "auto" else spec
    n = n or available
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


def decay_mask(params):
    """AdamW decays the weights of linear layers only (not embeddings, norms or
    biases)."""

    def mark(x):
        if not isinstance(x, zoo.Dense):
            return False
        return eqx.tree_at(lambda d: d.weight, jax.tree.map(lambda _: False, x), True)

    return jax.tree.map(mark, params, is_leaf=lambda x: isinstance(x, zoo.Dense))


OPTIMISER_FIELDS = ("steps", "lr", "schedule", "warmup", "min_lr_ratio")
OPTIMISER_FIELDS += ("weight_decay", "clip")


def make_optimizer(c: RunConfig) -> optax.GradientTransformation:
    """Clipping, then AdamW on the learning-rate schedule; one object per value of
    `OPTIMISER_FIELDS`, so that runs differing only in others reuse the compiled
    step."""
    return _optimizer(RunConfig(**{f: getattr(c, f) for f in OPTIMISER_FIELDS}))


@functools.lru_cache(maxsize=8)
def _optimizer(c: RunConfig) -> optax.GradientTransformation:
    decay = dict(weight_decay=c.weight_decay, mask=decay_mask)
    adamw = optax.adamw(learning_rate_schedule(c), b1=0.9, b2=0.95, **decay)
    return optax.chain(optax.clip_by_global_norm(c.clip), adamw)


@eqx.filter_jit
def init_state(c: RunConfig) -> TrainState:
    """A fresh `TrainState` from `c.seed` (jitted: one compile, not one per op)."""
    model_key, dropout_key = jr.split(jr.key(c.seed))
    sizes = (VOCAB_SIZE, c.seq, c.d_model, c.heads, c.layers)
    options = dict(d_ff=c.d_ff, dropout=c.dropout, dtype=jnp.dtype(c.dtype))
    model = zoo.Transformer(*sizes, **options, key=model_key)
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
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


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
    `jax.ShapeDtypeStruct`), by `eqx_remat.count_flops`: `(model, hardware)`,
    with `checkpoint=None` (for MFU) and with the state's own (for HFU)."""

    step = lambda s, t: step_fn((t, jnp.int32(0)), s, optimizer, None)
    count = lambda s: int(eqx_remat.count_flops(step, s, tokens))
    return count(eqx_remat.set_checkpoint(state, None)), count(state)
