"""Every private JAX symbol that eqx_remat and the zoo use, and nothing else.

This is the only module that imports `jax._src` (tests/test_layout.py checks it).
Each import is guarded, as Equinox's `_filters.py` guards its own: a JAX release
that moves a symbol turns off what it serves, with a fallback or a clear error,
rather than failing at `import eqx_remat`. Each symbol says what it is for and
the public alternative, where there is one. eqx_remat is tested with jax 0.10.2.
"""

import contextlib
from typing import Any

import jax
import jax.numpy as jnp


# Which trace a primitive bound now would be processed by, and the axis names of
# a `jax.vmap`'s trace: a schedule's `custom_vmap` rule batches with the same
# names, and the engine asks whether the innermost transformation is a `vmap`.
# No public alternative (`jax.custom_batching.custom_vmap` rules are not told the
# axis name).
try:
    from jax._src.core import no_axis_name as _no_axis_name, trace_ctx as _trace_ctx
    from jax._src.interpreters.batching import BatchTrace as _BatchTrace
except ImportError:  # pragma: no cover - depends on the jax version
    _trace_ctx = _BatchTrace = _no_axis_name = None

# Zeros of an abstract value with everything its type carries (weak type,
# sharding): what a skipped layer's `lax.cond` branch returns. Public
# alternative, which loses the weak type and sharding: `jnp.zeros(shape, dtype)`.
try:
    from jax._src.ad_util import zeros_like_aval as _zeros_like_aval
except ImportError:  # pragma: no cover - depends on the jax version
    _zeros_like_aval = None

# Dead-code elimination of a jaxpr, as XLA would do it: `count_flops` counts only
# what is computed. No public alternative.
try:
    from jax._src.interpreters import partial_eval as _pe
except ImportError:  # pragma: no cover - depends on the jax version
    _pe = None

# Source locations: an equation re-evaluated from a jaxpr keeps its file:line and
# name stack, and `residuals` says where each residual comes from. No public
# alternative; optional (without it, locations read "an unknown location").
try:
    from jax._src import source_info_util as _source_info_util
except ImportError:  # pragma: no cover - depends on the jax version
    _source_info_util = None

# Whether Pallas TPU kernels run in interpret mode (inside
# `jax.experimental.pallas.tpu.force_tpu_interpret_mode()`): the zoo's flash
# attention then runs off a TPU. No public alternative that reads the setting.
try:
    from jax._src import config as _config
except ImportError:  # pragma: no cover - depends on the jax version
    _config = None


def sees_traces() -> bool:
    """Whether this jax lets `innermost_is_vmap` tell (else it returns `False`)."""
    return _trace_ctx is not None and _BatchTrace is not None


def innermost_is_vmap() -> bool:
    """Whether the innermost transformation being traced is a `jax.vmap`."""
    if _trace_ctx is None or _BatchTrace is None:  # pragma: no cover - jax version
        return False
    return isinstance(_trace_ctx.trace, _BatchTrace)


def vmap_axis_names() -> dict[str, Any]:
    """The `axis_name` and `spmd_axis_name` of the innermost `jax.vmap`, as
    keyword arguments of `jax.vmap` (only those it was given)."""
    if _trace_ctx is None:  # pragma: no cover - depends on the jax version
        return {}
    axis = getattr(_trace_ctx.trace, "axis_data", None)
    name = getattr(axis, "name", None)
    spmd = getattr(axis, "spmd_name", None)
    names = {}
    if name is not None and name is not _no_axis_name:
        names["axis_name"] = name
    if spmd is not None:
        names["spmd_axis_name"] = spmd
    return names


def zeros_like_aval(aval: Any) -> jax.Array:
    """Zeros of the abstract value `aval`, with its weak type and sharding where
    this jax allows (else only its shape and dtype)."""
    if _zeros_like_aval is None:  # pragma: no cover - depends on the jax version
        return jnp.zeros(aval.shape, aval.dtype)
    return _zeros_like_aval(aval)


def dce_jaxpr(jaxpr: Any, used_outputs: list[bool], instantiate: bool) -> Any:
    """`jax._src.interpreters.partial_eval.dce_jaxpr`: `(jaxpr, used_inputs)`.

    **Raises:** `ImportError` where this jax does not have it.
    """
    if _pe is None or not hasattr(_pe, "dce_jaxpr"):  # pragma: no cover
        raise ImportError(
            "eqx_remat.count_flops needs jax's private "
            "`jax._src.interpreters.partial_eval.dce_jaxpr`, which this jax "
            f"({jax.__version__}) does not have. eqx_remat is tested with "
            "jax 0.10.2; install that version (pip install 'jax==0.10.2')."
        )
    return _pe.dce_jaxpr(jaxpr, used_outputs, instantiate)


def source_context(source_info: Any) -> contextlib.AbstractContextManager:
    """A context that binds primitives at the source location (traceback and
    name stack) of `source_info`, an equation's; a no-op where this jax does not
    allow it."""
    if _source_info_util is None:  # pragma: no cover - depends on the jax version
        return contextlib.nullcontext()
    try:
        name_stack = _source_info_util.current_name_stack() + source_info.name_stack
        return _source_info_util.user_context(
            source_info.traceback, name_stack=name_stack
        )
    except AttributeError:  # pragma: no cover - depends on the jax version
        return contextlib.nullcontext()


def summarize_source(source_info: Any) -> str | None:
    """`file.py:12 (function)` for an equation's `source_info`, or `None` where
    this jax does not say."""
    if _source_info_util is None:  # pragma: no cover - depends on the jax version
        return None
    return _source_info_util.summarize(source_info)


def pallas_interpreting() -> bool:
    """Whether Pallas TPU kernels run in interpret mode
    (`jax.experimental.pallas.tpu.force_tpu_interpret_mode()`)."""
    context = getattr(_config, "pallas_tpu_interpret_mode_context_manager", None)
    if context is None:  # pragma: no cover - depends on the jax version
        return False
    return context.value is not None


def remat3_set(value: bool) -> contextlib.AbstractContextManager:
    """Within: `jax_remat3` is `value` (JAX's remat3 on or off for the
    checkpoints traced there), as `jax.config.update` would set it, and as it
    was before after. No public alternative (`jax.config.update` sets it for
    the whole process). Without remat3 in this jax, or the private setting,
    nothing changes."""
    state = getattr(_config, "remat3", None)
    if state is None:  # pragma: no cover - depends on the jax version
        return contextlib.nullcontext()
    return state(value)
