"""Reverse-over-reverse through an offloading checkpoint under JAX's remat3: the
project's clear error at trace time, where JAX's would be `Expected cotangent
type float32[...] but got float32<host>[...]`.

Without remat3, JAX calls a policy again on the operations of the backward pass
when that is differentiated, and `Offloading` raises where it sees the reload of
an offloaded value. JAX's remat3 asks a policy only at matrix products and tags,
never on a backward pass's reload, so under it the checkpoint's inputs pass
through an identity (`guard`) whose derivative is marked: the first transpose
(the backward pass) passes the cotangent through one more mark, and transposing
that mark (differentiating the backward pass in reverse mode again) raises.
Forward-over-reverse (`jax.jvp` of `jax.grad`) transposes nothing more, and
works. The marks are identities: nothing is computed or saved for them.

The mark is a primitive of eqx_remat's, `eqx_remat_offload_guard`: JAX's public
way to say what a transpose does (`jax.custom_derivatives.linear_call`) cannot
be batched by `jax.vmap`.
"""

import functools
from typing import Any

import equinox as eqx
import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir


def second_order_offload_message(policy: str | None = None) -> str:
    """The error for differentiating the backward pass of an offloading policy
    in reverse mode again: naming `policy` (its repr) where it is known (under
    remat3), and this jax."""
    which = "an offloading policy" if policy is None else policy
    return (
        f"Differentiating the backward pass of {which} in reverse mode again "
        "(grad of grad) is not supported, for any offloading policy "
        "(offload_names, save_and_offload_names, 'offload_dots_no_batch'), "
        "with JAX's remat3 or without: JAX's offloading reloads the saved "
        "values from host memory in the backward pass, and differentiating "
        f"that reload fails in jax {jax.__version__} ('Expected cotangent type "
        "float32[...] but got float32<host>[...]'). Use the matching saving "
        "policy for higher-order derivatives (save_names with the same names — "
        "for save_and_offload_names, its save and offload names together — or "
        "'dots_no_batch'); forward-over-reverse (jax.jvp of jax.grad, "
        "jax.hessian) works."
    )


# The mark: an identity, linear, whose `transposes` counts how many times it has
# been transposed; the second transpose raises.
_mark_p = Primitive("eqx_remat_offload_guard")
_mark_p.def_impl(lambda x, *, transposes, policy: x)
_mark_p.def_abstract_eval(lambda x, *, transposes, policy: x)
mlir.register_lowering(
    _mark_p, mlir.lower_fun(lambda x, **_: x, multiple_results=False)
)
batching.defvectorized(_mark_p)


def _transpose(ct, x, *, transposes, policy):
    del x
    if transposes >= 1:
        raise NotImplementedError(second_order_offload_message(policy))
    return [_mark_p.bind(ct, transposes=transposes + 1, policy=policy)]


ad.deflinear2(_mark_p, _transpose)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _guard(policy: str, x: Any) -> Any:
    return x


@_guard.defjvp
def _guard_jvp(policy, primals, tangents):
    # The primal passes as it is (a layer's parameters stay the very values
    # read from the stack); only its tangent is marked.
    (x,), (t,) = primals, tangents
    return x, _mark_p.bind(t, transposes=0, policy=policy)


def guarded(checkpointed_fn: Any, policy: Any) -> Any:
    """`checkpointed_fn` (a `jax.checkpoint` with the offloading `policy`,
    under remat3) with its floating-point inputs passed through `_guard`: see
    the module's docstring."""
    name = repr(policy)

    @functools.wraps(checkpointed_fn)
    def fn(*args):
        def mark(x):
            return _guard(name, x) if eqx.is_inexact_array(x) else x

        return checkpointed_fn(*jax.tree.map(mark, args))

    return fn
