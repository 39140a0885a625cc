"""The chunked loss head: `zoo.cross_entropy` and `zoo.Transformer.loss` give the
whole logits' losses and gradients without ever holding the whole logits."""

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import check_close, raises_bad_input
from hypothesis import given

import eqx_remat
import zoo


# f32: a chunk's logsumexp is the same sum; the head's weight gradient is summed
# over chunks in another order. Seen: max absolute difference ~1e-6 on losses ~4.
def plain_loss(model, tokens):
    """The cross-entropy written out from the model's logits."""
    logits = jax.vmap(model)(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def model_loss(model, tokens):
    return jax.vmap(model.loss)(tokens[:, :-1], tokens[:, 1:]).mean()


@pytest.mark.heavy
@given(
    seq=st.integers(1, 12),
    chunk=st.one_of(st.none(), st.integers(1, 13)),
    batch=st.integers(1, 3),
)
def test_cross_entropy_equals_the_whole_logits(seq, chunk, batch):
    """For any length and chunk size (chunks that do not divide the sequence, one
    larger than it): the losses and the gradients (head weight and hidden) of
    the whole logits."""
    head = zoo.Dense(8, 32, use_bias=True, key=jr.key(0))
    hidden = jr.normal(jr.key(1), (batch, seq, 8))
    targets = jr.randint(jr.key(2), (batch, seq), 0, 32)

    def whole(head, hidden):
        logp = jax.nn.log_softmax(jax.vmap(head)(hidden))
        losses = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(losses**2), losses  # a non-linear use of every loss

    def chunked(head, hidden):
        f = lambda h, t: zoo.cross_entropy(head, h, t, chunk_size=chunk)
        losses = jax.vmap(f)(hidden, targets)
        return jnp.sum(losses**2), losses

    grad = eqx.filter_jit(eqx.filter_value_and_grad(whole, has_aux=True))
    ref = grad(head, hidden)
    grad = eqx.filter_value_and_grad(chunked, has_aux=True)
    check_close(eqx.filter_jit(grad)(head, hidden), ref)


@pytest.mark.parametrize(
    ("tie", "chunk"),
    [(False, None), (False, 3), (True, 3)],
    ids=["head-whole", "head-chunks", "tied-chunks"],
)
def test_transformer_loss_equals_the_logits_loss(tie, chunk):
    """`Transformer.loss` with and without `loss_chunk_size` (3 does not divide
    the 10 positions), with a separate or a tied head: the loss and gradients of the
    cross-entropy written out from `__call__`'s logits, with a name policy on
    the blocks (its tags are unchanged by the head)."""
    model = zoo.Transformer(
        32,
        11,
        8,
        2,
        2,
        tie_embeddings=tie,
        loss_chunk_size=chunk,
        checkpoint=eqx_remat.save_names("mlp_out"),
        key=jr.key(0),
    )
    assert model.activation_names == zoo.Transformer.ACTIVATION_NAMES
    tokens = jr.randint(jr.key(1), (3, 11), 0, 32)
    ref = eqx.filter_jit(eqx.filter_value_and_grad(plain_loss))(model, tokens)
    out = eqx.filter_jit(eqx.filter_value_and_grad(model_loss))(model, tokens)
    check_close(out, ref)


def test_bf16_chunked_loss_equals_the_whole():
    """A bfloat16 model: the chunked loss computes each chunk's logits as the
    whole head does (bf16 product, float32 softmax): float32 losses equal up to
    the rounding of bf16 logits (XLA rounds each product as it fuses it: seen
    3.6e-3 on losses ~4)."""
    model = zoo.Transformer(32, 9, 8, 2, 1, dtype=jnp.bfloat16, key=jr.key(0))
    tokens = jr.randint(jr.key(1), (9,), 0, 32)
    loss = eqx.filter_jit(lambda m: m.loss(tokens[:-1], tokens[1:]))
    whole, chunked = loss(model), loss(zoo.set_loss_chunk_size(model, 3))
    assert whole.dtype == chunked.dtype == jnp.float32
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-2)


def test_the_chunked_head_never_holds_the_logits():
    """Compiled temp memory of a value-and-grad step with a large vocabulary
    (batch 4 × 64 positions × 4096 = 4 MiB of float32 logits): the plain head's
    includes the logits (and their gradient); the chunked head's (chunks of 8
    positions) is less than the logits alone."""
    vocab, batch, seq = 4096, 4, 64
    model = eqx.filter_eval_shape(
        lambda: zoo.Transformer(vocab, seq, 16, 2, 2, key=jr.key(0))
    )
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    logits_bytes = batch * seq * vocab * 4
    grad = eqx.filter_value_and_grad(model_loss)
    plain = eqx_remat.memory_report(grad, model, tokens).temp_bytes
    model = zoo.set_loss_chunk_size(model, 8)
    chunked = eqx_remat.memory_report(grad, model, tokens).temp_bytes
    # Seen: 9692120 B plain, 2626648 B chunked.
    assert plain >= chunked + logits_bytes
    assert chunked < logits_bytes


def test_set_loss_chunk_size_switches_a_model_and_its_optimiser_state():
    model = zoo.Transformer(16, 4, 8, 2, 1, key=jr.key(0))
    states = (model, [model])
    chunked, [inner] = zoo.set_loss_chunk_size(states, 2)
    assert chunked.loss_chunk_size == inner.loss_chunk_size == 2
    assert chunked.token_embedding.weight is model.token_embedding.weight
    assert model.loss_chunk_size is None
    assert zoo.set_loss_chunk_size(chunked, None).loss_chunk_size is None


def test_errors_name_the_argument():
    key = jr.key(0)
    with pytest.raises(ValueError, match="Transformer: loss_chunk_size must be"):
        zoo.Transformer(16, 4, 8, 2, 1, loss_chunk_size=0, key=key)
    with raises_bad_input("loss_chunk_size must be an int", param="loss_chunk_size"):
        zoo.Transformer(16, 4, 8, 2, 1, loss_chunk_size="auto", key=key)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="set_loss_chunk_size: chunk_size must be"):
        zoo.set_loss_chunk_size(zoo.Transformer(16, 4, 8, 2, 1, key=key), 0)
    with pytest.raises(ValueError, match="a module with a `loss_chunk_size` field"):
        zoo.set_loss_chunk_size(zoo.MLP(2, 2, 2, 1, key=key), 4)
    head = zoo.Dense(8, 16, key=key)
    with pytest.raises(ValueError, match="cross_entropy: chunk_size must be"):
        zoo.cross_entropy(head, jnp.ones((4, 8)), jnp.zeros(4, jnp.int32), chunk_size=0)
    # A head that does not give one row of logits per position (broadcast
    # against the targets, it would give a loss of the wrong rows).
    with pytest.raises(ValueError, match=r"head to map .* logits of shape \(1, 16\)"):
        zoo.cross_entropy(
            lambda h: head(h)[:1], jnp.ones((4, 8)), jnp.zeros(4, jnp.int32)
        )
