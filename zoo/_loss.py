"""The loss head: next-token cross-entropy of a final projection, whole or over
chunks of the sequence whose logits are recomputed in the backward pass."""

from collections.abc import Callable
from typing import SupportsIndex, TypeVar

import jax
import jax.numpy as jnp
from beartype import beartype
from jax import lax
from jaxtyping import Array, Float, Int, jaxtyped

from eqx_remat.internal import check_int, map_loss_chunk_sizes

from ._layers import wide


_T = TypeVar("_T")


def _token_losses(logits: Array, targets: Array) -> Array:
    """`logsumexp(logits) - logits[target]` per row, in at least float32."""
    if logits.ndim != 2 or logits.shape[0] != targets.shape[0]:
        raise ValueError(
            "zoo.cross_entropy expected head to map (rows, d_model) to (rows, "
            f"vocab). Got logits of shape {logits.shape} for {targets.shape[0]} rows."
        )
    logits = logits.astype(wide(logits.dtype))
    target = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return jax.nn.logsumexp(logits, axis=-1) - target


@jaxtyped(typechecker=beartype)
def cross_entropy(
    head: Callable[[Float[Array, "rows d_model"]], Float[Array, "rows vocab"]],
    hidden: Float[Array, "seq d_model"],
    targets: Int[Array, " seq"],
    *,
    chunk_size: SupportsIndex | None = None,
) -> Float[Array, " seq"]:
    """The cross-entropy `-log softmax(head(hidden))[targets]` of each position,
    with the logits whole or, with `chunk_size`, never whole.

    A language model's logits, `(batch, seq, vocab)`, are often the largest
    buffer of its training step (batch 4 × 2048 tokens × a vocabulary of 32000 in
    float32: 1 GiB, and as much again for their gradient). With `chunk_size`,
    the positions are taken `chunk_size` at a time in a `lax.scan`; each chunk's
    logits are computed, reduced to its losses and dropped, and the backward
    pass recomputes them chunk by chunk (`jax.checkpoint` around the chunk,
    saving nothing): the step holds one chunk's logits, `(batch, chunk_size,
    vocab)` under `jax.vmap`, at the cost of the head's forward product once
    more. Losses and gradients are those of the whole logits (up to the order
    of float sums).

    ```python
    hidden = ...  # (seq, d_model): the final norm's output of one sequence
    losses = zoo.cross_entropy(model.head, hidden, targets, chunk_size=256)
    ```

    [`zoo.Transformer.loss`][] computes it for its own head, with its
    `loss_chunk_size`.

    **Arguments:**

    - `head`: the output projection, `(rows, d_model) -> (rows, vocab)`: a
      [`zoo.Dense`][], or any function (e.g. `lambda h: h @ embedding.T` for
      tied embeddings). Under `chunk_size` it is called on `(chunk_size,
      d_model)` rows at a time.
    - `hidden`: the features of one sequence, `(seq, d_model)`. Batch with
      `jax.vmap`.
    - `targets`: the target token ids, `(seq,)`, in `[0, vocab)`.
    - `chunk_size`: `None` (default): the logits of all positions at once.
      An int >= 1: positions per chunk; a last chunk that is not full is
      padded (and the padding dropped from the result). (Keyword only.)

    **Returns:**

    The loss of each position, `(seq,)`, in at least float32: take its mean
    (over the batch too) for the usual language-model loss.

    **Raises:**

    `ValueError` naming `chunk_size` when it is not `None` or an int >= 1.
    """
    if chunk_size is None:
        return _token_losses(head(hidden), targets)
    size = check_int("zoo.cross_entropy", "chunk_size", chunk_size, 1)
    seq, d_model = hidden.shape
    chunks = -(-seq // size)
    pad = chunks * size - seq
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(chunks, size, d_model)
    t = jnp.pad(targets, (0, pad)).reshape(chunks, size)

    # Saves nothing: the backward pass recomputes the chunk's logits from its
    # rows of `hidden` (kept by the scan) and the head's weights.
    @jax.checkpoint
    def chunk(h: Array, t: Array) -> Array:
        return _token_losses(head(h), t)

    _, losses = lax.scan(lambda _, ht: (None, chunk(*ht)), None, (h, t))
    return losses.reshape(chunks * size)[:seq]


def set_loss_chunk_size(tree: _T, chunk_size: SupportsIndex | None) -> _T:
    """A copy of `tree` with every `loss_chunk_size` field (a
    [`zoo.Transformer`][]'s) set to `chunk_size`: switch the loss head of a model
    already built or trained, as [`eqx_remat.set_checkpoint`][] switches its
    checkpoint.

    The field is static, part of the model's pytree structure, and an optimiser
    state made from the model holds copies of its modules: switch both in one
    call, `model, opt_state = zoo.set_loss_chunk_size((model, opt_state), 256)`.

    **Arguments:**

    - `tree`: any pytree holding modules with a `loss_chunk_size` field.
    - `chunk_size`: `None` (the whole logits) or an int >= 1 (see
      [`zoo.cross_entropy`][]).

    **Returns:**

    The same pytree, with the same arrays, and `chunk_size` in every
    `loss_chunk_size` field.

    **Raises:**

    `ValueError` naming `chunk_size` when it is not `None` or an int >= 1, or
    when `tree` holds no module with a `loss_chunk_size` field.
    """
    fn = "zoo.set_loss_chunk_size"
    if chunk_size is not None:
        chunk_size = check_int(fn, "chunk_size", chunk_size, 1)
    out, found = map_loss_chunk_sizes(tree, lambda _: chunk_size)
    if not found:
        raise ValueError(
            f"{fn} expected a pytree containing a module with a `loss_chunk_size` "
            f"field (a zoo.Transformer). Got {type(tree).__name__} without one."
        )
    return out
