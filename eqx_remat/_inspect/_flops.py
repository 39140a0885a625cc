"""Counting FLOPs by walking a function's jaxpr.

XLA's `compiled.cost_analysis()["flops"]` counts the body of a loop once, whatever
its trip count, so it cannot measure a scanned stack of layers, nor the extra
forward passes that checkpointing adds. `count_flops` walks the jaxpr instead,
multiplying loop bodies by their trip counts, and counts each primitive the way
XLA's `HloCostAnalysis` does, so that on loop-free programs the two agree.
"""

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_private
from .._util import traceable
from ._jaxpr import (
    called_jaxpr,
    hi_operation,
    is_literal,
    jaxpr_and_consts,
    open_jaxpr,
    producers,
    scan_sizes,
    sub_jaxprs,
    tag_name,
)


def _dce_jaxpr(jaxpr: Any, used_outputs: list[bool], instantiate: bool) -> Any:
    return _jax_private.dce_jaxpr(jaxpr, used_outputs, instantiate)


class FlopCount(int):
    """The FLOPs of a function: an `int`, with what was counted apart from it.

    It is the number of floating-point (and integer) operations, so it compares,
    adds and divides like an `int` (arithmetic returns plain `int`s).

    **Attributes:**

    - `transcendentals`: the number of transcendental operations (`exp`, `log`,
      `tanh`, `sin`, `sqrt`, `rsqrt`, `erf`, `pow`, ...), counted apart from the
      FLOPs, as XLA's `cost_analysis()["transcendentals"]` does.
    - `unknown`: the primitives that `count_flops` has no rule for, counted as
      zero FLOPs: a mapping from primitive name to the number of times it runs
      (loop trip counts included). Empty when every operation was counted.
    - `dynamic_loops`: the number of `while` loops whose trip count is not known
      when tracing; the body of each was counted once.
    - `dot_bytes`: the bytes the matrix products (`dot_general`, convolutions)
      read and write, operands and results, counted as the FLOPs are (trip
      counts and recomputation included): the traffic a roofline charges
      them ([`eqx_remat.plan`][]).
    """

    transcendentals: int
    unknown: Mapping[str, int]
    dynamic_loops: int
    dot_bytes: int

    def __new__(
        cls,
        flops: int,
        transcendentals: int = 0,
        unknown: Mapping[str, int] | None = None,
        dynamic_loops: int = 0,
        dot_bytes: int = 0,
    ):
        self = super().__new__(cls, flops)
        self.transcendentals = int(transcendentals)
        self.unknown = dict(sorted((unknown or {}).items()))
        self.dynamic_loops = int(dynamic_loops)
        self.dot_bytes = int(dot_bytes)
        return self

    def __repr__(self) -> str:
        return (
            f"FlopCount({int(self)}, transcendentals={self.transcendentals}, "
            f"unknown={self.unknown}, dynamic_loops={self.dynamic_loops}, "
            f"dot_bytes={self.dot_bytes})"
        )

    def __reduce__(self):
        return (
            FlopCount,
            (
                int(self),
                self.transcendentals,
                self.unknown,
                self.dynamic_loops,
                self.dot_bytes,
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        """The count as a JSON-serialisable `dict`."""
        return {
            "flops": int(self),
            "transcendentals": self.transcendentals,
            "unknown": dict(self.unknown),
            "dynamic_loops": self.dynamic_loops,
            "dot_bytes": self.dot_bytes,
        }


def count_flops(fn: Callable[..., Any], *args: Any) -> FlopCount:
    """Count the FLOPs of `fn(*args)`, including loop trip counts and
    recomputation.

    The function is traced (nothing is compiled or run) and its jaxpr walked:

    - the body of a `lax.scan` counts `length` times; a `while` loop counts its
      body as many times as it runs when the trip count is static (the pattern
      `lax.fori_loop` produces with constant bounds), else once — and
      `dynamic_loops` says how many loops that was;
    - a `lax.cond` / `lax.switch` counts the branch that runs when its index
      is known while counting — computed only from constants of the program
      (NumPy tables, `jnp.arange`, literals) and the iterations of the
      `lax.scan`s around it, as in `binomial`'s action table and the padding of
      an uneven depth schedule — and its most expensive branch otherwise. So
      every depth schedule is counted exactly: its layer evaluations are those
      of `Schedule.evaluations`;
    - calls (`jax.jit`, `jax.checkpoint`, `custom_jvp` / `custom_vjp` /
      `custom_vmap` functions, `shard_map` once per device) count their bodies
      (under JAX's remat3, `jax_remat3=True`, a checkpoint is a higher-order
      operation that calls its jaxpr: counted alike, so a count is the same
      with remat3 and without). In a jaxpr of `jax.grad(f)`, the backward
      pass — custom VJPs and the recomputation of `jax.checkpoint` included —
      is already expanded, so pass `jax.grad(loss)` (or
      `jax.value_and_grad`) to count a training step;
    - dead code is dropped first, as XLA would (e.g. the loss value that
      `jax.grad` computes and discards).

    Each primitive counts as XLA's `HloCostAnalysis` counts it, so on loop-free
    functions the total equals `jax.jit(fn).lower(*args).compile()
    .cost_analysis()["flops"]` up to what XLA's optimisations change (common
    subexpressions computed once, constant folding; on the CPU, bf16 matmuls
    computed in f32 with extra conversions):

    - `dot_general`: `2 · batch · M · N · K` (as XLA simplifies them: `K = 1`
      is a multiply, `M · N = 1` a multiply and a sum); `conv_general_dilated`:
      2 per multiply-add that touches the input (padding skipped, like XLA);
    - elementwise arithmetic, comparisons, `select_n`, type conversions: 1 per
      output element (`integer_pow`: its multiplies); a `reduce_precision`
      that keeps its dtype's precision, the marker JAX puts on the values a
      checkpoint saves, is an identity: 0 (XLA counts 1 per element);
    - transcendental functions (`exp`, `log`, `tanh`, `sqrt`, `erf`, `pow`, ...):
      1 *transcendental* per element, not a FLOP — reported in
      `.transcendentals`; functions XLA expands into several operations
      (`logistic`, `erfc`, `lgamma`, `sinh`, ...) count as XLA's f32 expansion
      in jaxlib 0.10.2, whatever the jax installed (jaxlib 0.12 compiles some
      of them otherwise: `sinh` as one operation that its cost analysis counts
      as one transcendental, `lgamma` as a library call it does not count), so
      that the count of a program does not change with the jax installed;
    - reductions: one operation per input element that is combined into an
      output (`size(in) - size(out)`); `reduce_window`: `size(out) ·
      (window - 1)`; `scatter-add` and friends: 1 per update element;
    - data movement (reshape, transpose, slicing, gather, scatter, padding,
      broadcasting, concatenation, sharding annotations): 0.

    Primitives without a rule (sorting, cumulative sums, random bit generation,
    collectives, custom kernels, ...) count as zero and are listed in
    `.unknown`, never silently dropped.

    **Arguments:**

    - `fn`: the function to count. Pass `jax.grad(loss)` to count a backward
      pass.
    - `*args`: its arguments, any pytrees (Equinox modules included). Array
      leaves may be `jax.ShapeDtypeStruct`s; nothing is allocated. Non-array
      leaves (Python numbers included) are static, as in `eqx.filter_jit`.

    **Returns:**

    A [`eqx_remat.FlopCount`][]: the number of FLOPs (an `int`), with
    `.transcendentals`, `.unknown` and `.dynamic_loops`.
    """
    f, dynamic = traceable(fn, args)  # shardings dropped: the whole program
    closed = jax.make_jaxpr(f)(dynamic)
    jaxpr, _ = _dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), True)
    acc = _Count()
    known = {
        v: np.asarray(c)
        for v, c in zip(closed.jaxpr.constvars, closed.consts)
        if _is_int(c)
    }
    _count_jaxpr(jaxpr, acc, 1, _Memo(), known)
    return FlopCount(
        acc.flops, acc.transcendentals, acc.unknown, acc.dynamic_loops, acc.dot_bytes
    )


@dataclasses.dataclass
class _Count:
    flops: int = 0
    transcendentals: int = 0
    unknown: collections.Counter = dataclasses.field(
        default_factory=collections.Counter
    )
    dynamic_loops: int = 0
    dot_bytes: int = 0

    def add(self, other: "_Count", mult: int) -> None:
        self.flops += mult * other.flops
        self.transcendentals += mult * other.transcendentals
        self.dot_bytes += mult * other.dot_bytes
        for k, v in other.unknown.items():
            self.unknown[k] += mult * v
        self.dynamic_loops += other.dynamic_loops


def _size(var: Any) -> int:
    return math.prod(getattr(var.aval, "shape", ()))


def _out_size(eqn) -> int:
    return sum(_size(v) for v in eqn.outvars)


# --- per-primitive rules: eqn -> (flops, transcendentals) --------------------

# One FLOP per output element.
_ELEMENTWISE = frozenset(
    """
    abs add add_any sub mul div rem max min neg sign floor ceil round is_finite
    square eq ne lt le gt ge and or xor not shift_left shift_right_logical
    shift_right_arithmetic population_count clz clamp conj real
    imag complex bitcast_convert_type mulhi
    """.split()
)

# (FLOPs, transcendentals) per output element. Single transcendentals are as in
# XLA's HloCostAnalysis; the others are how XLA expands them (measured with
# jaxlib 0.10.2 on f32, where cost_analysis counts the expansion). One
# convention whatever the jaxlib: jaxlib 0.12 lowers exp2 and sinh to single
# operations, other polynomials for erfc and erf_inv, and lgamma and digamma to
# custom calls its cost analysis cannot count (tests/test_inspect.py's
# XLA_COUNTS has its figures).
_PER_ELEMENT = {
    **{
        name: (0, 1)
        for name in """
        exp log log1p expm1 tanh sin cos tan atan atan2 sqrt rsqrt cbrt erf pow
        """.split()
    },
    "exp2": (1, 1),
    "logistic": (3, 1),
    "asin": (5, 2),
    "acos": (3, 2),
    "sinh": (10, 3),
    "cosh": (3, 2),
    "asinh": (11, 3),
    "acosh": (7, 4),
    "atanh": (6, 2),
    "erfc": (60, 1),
    "erf_inv": (37, 2),
    "lgamma": (52, 4),
    "digamma": (73, 3),
    "bessel_i0e": (83, 1),
    "bessel_i1e": (83, 1),
    "nextafter": (23, 0),
    # jax 0.11's derivative of tanh, 1 - x**2: counted as (1 - x) * (1 + x),
    # three FLOPs, and not held against XLA's cost analysis (this machine's jax,
    # 0.10.2, has no such primitive).
    "one_minus_square": (3, 0),
}

_REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or "
    "reduce_xor".split()
)

_REDUCE_WINDOWS = frozenset(
    "reduce_window_sum reduce_window_max reduce_window_min".split()
)

_SCATTER_COMBINE = frozenset(
    "scatter-add scatter-sub scatter-mul scatter-min scatter-max".split()
)

_FREE = frozenset(
    """
    broadcast_in_dim broadcast_to reshape squeeze transpose slice dynamic_slice
    dynamic_update_slice gather scatter concatenate pad rev iota copy
    device_put name optimization_barrier sharding_constraint reshard pvary
    stop_gradient split tile stack unstack random_wrap random_unwrap axis_index
    create_token after_all debug_callback debug_print layout_constraint
    inspect_sharding zeros_like empty shape_assertion platform_index tie pin
    unpin mesh_cast
    """.split()
    # eqx_remat's own identity on the derivatives of an offloading checkpoint's
    # inputs under remat3 (eqx_remat/_policies/_second_order.py).
    + ["eqx_remat_offload_guard"]
)


# Matrix products: what `dot_bytes` counts.
_PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})


def _convert(eqn) -> tuple[int, int]:
    # XLA drops conversions that do not change the dtype (only weak typing).
    (x,) = eqn.invars
    if x.aval.dtype == eqn.params["new_dtype"]:
        return 0, 0
    return _out_size(eqn), 0


def _reduce_precision(eqn) -> tuple[int, int]:
    # A rounding to at least its dtype's own precision is an identity: the
    # marker JAX puts on the values a checkpoint saves, at other values under
    # remat3 than under the checkpoint before it. 0, so that a count does not
    # depend on which (XLA's cost analysis counts one per element all the same).
    (x,) = eqn.invars
    dtype = x.aval.dtype
    if np.issubdtype(dtype, np.floating):
        info = jnp.finfo(dtype)
        p = eqn.params
        if p["exponent_bits"] >= info.nexp and p["mantissa_bits"] >= info.nmant:
            return 0, 0
    return _out_size(eqn), 0


def _integer_pow(eqn) -> tuple[int, int]:
    # jax lowers x ** y to square-and-multiply, plus a division for y < 0.
    y = eqn.params["y"]
    if y == 0:
        return 0, 0
    n = abs(y)
    muls = n.bit_length() - 1 + bin(n).count("1") - 1 + (1 if y < 0 else 0)
    return muls * _out_size(eqn), 0


def _select_n(eqn) -> tuple[int, int]:
    # A boolean predicate is one select; an integer one is a tree of
    # compare-and-select.
    which, *cases = eqn.invars
    per = 1 if which.aval.dtype == np.bool_ else 2 * (len(cases) - 1)
    return per * _out_size(eqn), 0


def _reduction(eqn) -> tuple[int, int]:
    return _size(eqn.invars[0]) - _size(eqn.outvars[0]), 0


def _argminmax(eqn) -> tuple[int, int]:
    # XLA's comparator of the (value, index) reduction: 9 operations for floats
    # (NaN handling), 7 for integers.
    per = 9 if np.issubdtype(eqn.invars[0].aval.dtype, np.inexact) else 7
    return per * (_size(eqn.invars[0]) - _size(eqn.outvars[0])), 0


def _reduce_window(eqn) -> tuple[int, int]:
    window = math.prod(eqn.params["window_dimensions"])
    return _out_size(eqn) * (window - 1), 0


def _scatter_combine(eqn) -> tuple[int, int]:
    # operand, indices, updates
    return _size(eqn.invars[2]), 0


def _dot_general(eqn) -> tuple[int, int]:
    lhs, rhs = eqn.invars[:2]
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    batch = math.prod(lhs.aval.shape[i] for i in lb)
    k = math.prod(lhs.aval.shape[i] for i in lc)
    out = _out_size(eqn)
    # XLA's algebraic simplifier turns a dot without contraction into a multiply,
    # and one with a single output element (per batch) into multiply + reduce.
    if k == 1:
        return out, 0
    if out == batch:
        return batch * (2 * k - 1), 0
    return 2 * out * k, 0


def _conv(eqn) -> tuple[int, int]:
    """XLA's `HloCostAnalysis::GetConvolutionFlops`: two FLOPs per multiply-add
    whose input position is inside the (dilated, unpadded) input."""
    p = eqn.params
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    out = eqn.outvars[0].aval.shape
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    batch, in_feature = lhs[lhs_spec[0]], lhs[lhs_spec[1]]
    out_feature = out[out_spec[1]]
    n_spatial = len(lhs_spec) - 2
    valid = 1
    for s in range(n_spatial):
        k_lim = rhs[rhs_spec[2 + s]]
        o_lim = out[out_spec[2 + s]]
        i_lim = lhs[lhs_spec[2 + s]]
        stride = p["window_strides"][s]
        pad_lo = p["padding"][s][0]
        base = p["lhs_dilation"][s]
        wdil = p["rhs_dilation"][s]
        count = 0
        for k in range(k_lim):
            o = np.arange(o_lim)
            undilated = o * stride - pad_lo + k * wdil
            ok = undilated % base == 0
            idx = undilated // base
            count += int(np.sum(ok & (idx >= 0) & (idx < i_lim)))
        valid *= count
    fma = (
        (in_feature // p["feature_group_count"])
        * out_feature
        * (batch // p["batch_group_count"])
        * valid
    )
    return 2 * fma, 0


def _pallas_call(eqn) -> tuple[int, int] | None:
    """A Pallas kernel counts what its `cost_estimate` says (`pl.CostEstimate`,
    which `pallas_call` takes and XLA's cost analysis reads too); one without an
    estimate cannot be counted (`None`: it is listed in `FlopCount.unknown`)."""
    cost = eqn.params.get("cost_estimate")
    if cost is None:
        return None
    return int(cost.flops), int(cost.transcendentals)


_RULES: dict[str, Callable[[Any], tuple[int, int] | None]] = {
    "pallas_call": _pallas_call,
    "convert_element_type": _convert,
    "reduce_precision": _reduce_precision,
    "integer_pow": _integer_pow,
    "select_n": _select_n,
    "argmax": _argminmax,
    "argmin": _argminmax,
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    **{name: (lambda eqn: (_out_size(eqn), 0)) for name in _ELEMENTWISE},
    **{
        name: (lambda eqn, f=f, t=t: (f * _out_size(eqn), t * _out_size(eqn)))
        for name, (f, t) in _PER_ELEMENT.items()
    },
    **{name: _reduction for name in _REDUCTIONS},
    **{name: _reduce_window for name in _REDUCE_WINDOWS},
    **{name: _scatter_combine for name in _SCATTER_COMBINE},
    **{name: (lambda eqn: (0, 0)) for name in _FREE},
}


# --- control flow decided by constants ---------------------------------------
#
# A `lax.cond` counts its most expensive branch, unless its branch index is
# known while counting: computed only from constants of the program (arrays
# built from NumPy tables, `jnp.arange`, literals) and the iteration of the
# `lax.scan`s it is in. Then the branch that runs is counted, iteration by
# iteration. This is how a schedule whose actions come from a table
# (`binomial`), or whose padded layers are skipped, is counted exactly.

# Integer arithmetic and indexing that is evaluated on known values.
_EVALUABLE = frozenset(
    """
    add sub mul div rem max min neg abs sign eq ne lt le gt ge and or not xor
    shift_left shift_right_logical shift_right_arithmetic convert_element_type
    select_n clamp squeeze reshape broadcast_in_dim slice dynamic_slice iota
    concatenate expand_dims
    """.split()
)


def _value(v: Any, known: dict) -> np.ndarray | None:
    if is_literal(v):
        return np.asarray(v.val)
    x = known.get(v)
    return None if x is None else np.asarray(x)


def _is_int(x: Any) -> bool:
    try:
        x = np.asarray(x)
    except Exception:  # e.g. PRNG keys
        return False
    return x.dtype.kind in "biu"


def _dynamic_slice(x, *idx, slice_sizes):
    starts = [int(np.clip(i, 0, d - n)) for i, d, n in zip(idx, x.shape, slice_sizes)]
    return x[tuple(slice(a, a + n) for a, n in zip(starts, slice_sizes))]


# NumPy versions of the common integer operations (an eager JAX op costs ~100x
# more, and counting a deep schedule evaluates thousands of them).
_NUMPY: dict[str, Callable[..., Any]] = {
    "add": lambda a, b, **_: a + b,
    "sub": lambda a, b, **_: a - b,
    "mul": lambda a, b, **_: a * b,
    "max": lambda a, b, **_: np.maximum(a, b),
    "min": lambda a, b, **_: np.minimum(a, b),
    "neg": lambda a, **_: -a,
    "eq": lambda a, b, **_: a == b,
    "ne": lambda a, b, **_: a != b,
    "lt": lambda a, b, **_: a < b,
    "le": lambda a, b, **_: a <= b,
    "gt": lambda a, b, **_: a > b,
    "ge": lambda a, b, **_: a >= b,
    "and": lambda a, b, **_: a & b,
    "or": lambda a, b, **_: a | b,
    "not": lambda a, **_: ~a,
    "shift_left": lambda a, b, **_: a << b,
    "shift_right_arithmetic": lambda a, b, **_: a >> b,
    "convert_element_type": lambda a, new_dtype, **_: a.astype(new_dtype),
    "select_n": lambda w, *cases, **_: np.choose(w.astype(np.int64), cases),
    "clamp": lambda lo, x, hi, **_: np.clip(x, lo, hi),
    "squeeze": lambda a, dimensions, **_: np.squeeze(a, tuple(dimensions)),
    "reshape": lambda a, new_sizes, **_: np.reshape(a, new_sizes),
    "broadcast_in_dim": lambda a, shape, broadcast_dimensions, **_: np.broadcast_to(
        np.expand_dims(
            a,
            tuple(d for d in range(len(shape)) if d not in broadcast_dimensions),
        ),
        shape,
    ),
    "slice": lambda a, start_indices, limit_indices, strides=None, **_: a[
        tuple(
            slice(s, e, st)
            for s, e, st in zip(start_indices, limit_indices, strides or [1] * a.ndim)
        )
    ],
    "dynamic_slice": _dynamic_slice,
    "iota": lambda dtype, shape, dimension, **_: np.broadcast_to(
        np.expand_dims(
            np.arange(shape[dimension], dtype=dtype),
            tuple(d for d in range(len(shape)) if d != dimension),
        ),
        shape,
    ),
}


@functools.cache
def _cpu_mesh() -> jax.sharding.Mesh:
    """One device to compute branch-deciding values on: the CPU, or, where JAX
    runs without its CPU backend (`JAX_PLATFORMS=cuda`, which initialises only
    the platforms it names), the first local device of the default backend."""
    try:
        device = jax.devices("cpu")[0]
    except RuntimeError:  # "Unknown backend cpu"
        device = jax.local_devices()[0]
    return jax.sharding.Mesh(np.array([device]), ("cpu",))


def _evaluate(eqn, known: dict, needed: frozenset) -> None:
    """Record the outputs of `eqn` in `known` if they may decide a branch
    (`needed`, see `_needed`) and can be computed now. Whatever their size:
    values that decide no branch (an attention mask's `iota`) are never
    computed, and a table that does (`binomial`'s) is exact at any depth."""
    name = eqn.primitive.name
    if name not in _EVALUABLE or not any(o in needed for o in eqn.outvars):
        return
    if not all(
        getattr(o.aval, "dtype", np.dtype(np.float32)).kind in "biu"
        for o in eqn.outvars
    ):
        return
    vals = [_value(v, known) for v in eqn.invars]
    if any(x is None for x in vals):
        return
    fast = _NUMPY.get(name)
    if fast is not None:
        try:
            out = np.asarray(fast(*vals, **eqn.params))
        except Exception:  # an unusual parameter: let JAX compute it
            fast = None
        else:
            if out.shape == eqn.outvars[0].aval.shape:
                known[eqn.outvars[0]] = out.astype(eqn.outvars[0].aval.dtype)
                return
    # Computed on this machine's CPU (`_cpu_mesh`) whatever mesh is in context
    # (a mesh of TPU v5e chips compiled for ahead of time has none to run on),
    # and unsharded: where the value lives does not change it.
    params = {**eqn.params, **({"sharding": None} if "sharding" in eqn.params else {})}
    with jax.set_mesh(_cpu_mesh()), jax.ensure_compile_time_eval():
        outs = eqn.primitive.bind(*vals, **params)
    outs = outs if eqn.primitive.multiple_results else [outs]
    for v, o in zip(eqn.outvars, outs):
        known[v] = np.asarray(o)


def _bind(jaxpr, args: list, known: dict, consts: Any = ()) -> dict:
    """Known values of a sub-jaxpr's inputs, from the values of the arguments
    passed to it (`args`, aligned with its invars) and its own constants."""
    out = {}
    for v, c in zip(jaxpr.constvars, consts):
        if _is_int(c):
            out[v] = np.asarray(c)
    if len(args) == len(jaxpr.invars):
        for v, a in zip(jaxpr.invars, args):
            x = _value(a, known)
            if x is not None:
                out[v] = x
    return out


@dataclasses.dataclass
class _Memo:
    """What one `count_flops` call has worked out, owned by that call (so that
    counting is re-entrant and thread-safe) and dropped with it: keyed by the
    `id` of a jaxpr, each entry holds the jaxpr too (so that its `id` is not
    reused while the memo lives)."""

    # `_control` of a jaxpr: id -> (jaxpr, positions)
    control: dict = dataclasses.field(default_factory=dict)
    # counts of a jaxpr: (id, deciding values...) -> (jaxpr, _Count)
    counts: dict = dataclasses.field(default_factory=dict)
    # `_needed` of a jaxpr: id -> (jaxpr, variables)
    needed: dict = dataclasses.field(default_factory=dict)
    # `_count_hi`: id of an operation -> (operation, its expansion or None)
    expansions: dict = dataclasses.field(default_factory=dict)


def _control(jaxpr, memo: _Memo) -> frozenset[int]:
    """The positions of `jaxpr`'s inputs that may decide the branch of a
    `lax.cond` in it (conservatively)."""
    key = id(jaxpr)
    hit = memo.control.get(key)
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    deps: dict = {v: {k} for k, v in enumerate(jaxpr.invars)}
    control: set[int] = set()
    for eqn in jaxpr.eqns:
        ins = [set() if is_literal(v) else deps.get(v, set()) for v in eqn.invars]
        every = set().union(*ins)
        name = eqn.primitive.name
        subs = [open_jaxpr(j) for j in sub_jaxprs(eqn)]
        if name == "cond":
            control |= ins[0]
            for b in subs:
                control |= {d for k in _control(b, memo) for d in ins[1 + k]}
        elif name == "scan" or called_jaxpr(eqn) is not None:
            for b in subs:
                if len(b.invars) == len(ins):
                    control |= {d for k in _control(b, memo) for d in ins[k]}
                elif _control(b, memo):
                    control |= every
        elif any(_control(b, memo) for b in subs):
            control |= every
        for o in eqn.outvars:
            deps[o] = every
    result = frozenset(control)
    memo.control[key] = (jaxpr, result)
    return result


def _needed(jaxpr, memo: _Memo) -> frozenset:
    """The variables of `jaxpr` whose values may decide the branch of a
    `lax.cond` in it, or in a jaxpr it calls (`_control`): the only values
    worth computing while counting."""
    key = id(jaxpr)
    hit = memo.needed.get(key)
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    need: set = set()

    def add(vs):
        need.update(v for v in vs if not is_literal(v))

    for eqn in reversed(jaxpr.eqns):
        ins = eqn.invars
        if eqn.primitive.name == "cond":
            add(ins[:1])
            ins = ins[1:]
        if any(o in need for o in eqn.outvars):
            add(ins)
        for b in sub_jaxprs(eqn):
            b = open_jaxpr(b)
            if len(b.invars) == len(ins):
                add(ins[k] for k in _control(b, memo))
    result = frozenset(need)
    memo.needed[key] = (jaxpr, result)
    return result


def _count_jaxpr(
    jaxpr, acc: _Count, mult: int, memo: _Memo, known: dict | None = None
) -> None:
    """Count `jaxpr` (`known`: values of its inputs known while counting).
    Its count depends only on the known inputs that may decide a branch
    (`_control`), so it is computed once per distinct such values."""
    known = known or {}
    control = _control(jaxpr, memo)
    key = (id(jaxpr),) + tuple(
        None if (x := known.get(jaxpr.invars[k])) is None else x.tobytes()
        for k in sorted(control)
    )
    hit = memo.counts.get(key)
    if hit is None or hit[0] is not jaxpr:
        count = _Count()
        _count_eqns(jaxpr, count, memo, dict(known))
        hit = memo.counts[key] = (jaxpr, count)
    acc.add(hit[1], mult)


def _count_eqns(jaxpr, acc: _Count, memo: _Memo, known: dict) -> None:
    mult = 1
    needed = _needed(jaxpr, memo)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        rule = _RULES.get(name)
        counted = None if rule is None else rule(eqn)
        if counted is not None:
            f, t = counted
            acc.flops += mult * f
            acc.transcendentals += mult * t
            if name in _PRODUCTS:
                acc.dot_bytes += mult * sum(
                    _size(v) * v.aval.dtype.itemsize
                    for v in (*eqn.invars, *eqn.outvars)
                )
            _evaluate(eqn, known, needed)
        elif (called := called_jaxpr(eqn)) is not None:
            sub, consts = jaxpr_and_consts(called)
            _count_jaxpr(sub, acc, mult, memo, _bind(sub, eqn.invars, known, consts))
        elif hi_operation(eqn) is not None:
            _count_hi(eqn, acc, mult, memo)
        elif name == "scan":
            _count_scan(eqn, acc, mult, memo, known)
        elif name == "while":
            _count_while(eqn, acc, mult, memo)
        elif name == "cond":
            _count_cond(eqn, acc, mult, memo, known)
        elif name == "shard_map":
            # The body runs once per device of the axes it makes manual.
            mesh = eqn.params["mesh"]
            axes = eqn.params.get("newly_manual_axes") or mesh.axis_names
            shards = math.prod(dict(mesh.shape)[a] for a in axes)
            _count_jaxpr(open_jaxpr(eqn.params["jaxpr"]), acc, mult * shards, memo)
        else:
            acc.unknown[name] += mult


def _count_hi(eqn, acc: _Count, mult: int, memo: _Memo) -> None:
    """A higher-order operation of JAX's (`call_hi_primitive`) other than a
    call: a `checkpoint_name` tag of remat3 is an identity, free; any other
    counts as what it expands to (its `expand`, JAX's definition of it in
    ordinary primitives, traced once per operation), or, where it cannot be
    expanded, is listed in `unknown` under its class's name."""
    hi = hi_operation(eqn)
    if tag_name(eqn) is not None:
        return
    hit = memo.expansions.get(id(hi))
    if hit is None or hit[0] is not hi:
        try:
            flat = jax.make_jaxpr(
                lambda *a: hi.expand(*jax.tree.unflatten(hi.in_tree, a))
            )(*hi.in_avals_flat)
        except Exception:  # an operation JAX gives no expansion
            flat = None
        hit = memo.expansions[id(hi)] = (hi, flat)
    expansion = hit[1]
    if expansion is None:
        acc.unknown[type(hi).__name__] += mult
    else:
        _count_jaxpr(expansion.jaxpr, acc, mult, memo)


def _count_cond(eqn, acc: _Count, mult: int, memo: _Memo, known: dict) -> None:
    branches = [jaxpr_and_consts(b) for b in eqn.params["branches"]]
    operands = eqn.invars[1:]
    index = _value(eqn.invars[0], known)
    if index is not None and index.ndim == 0:
        sub, consts = branches[int(np.clip(index, 0, len(branches) - 1))]
        _count_jaxpr(sub, acc, mult, memo, _bind(sub, operands, known, consts))
        return
    counts = []
    for sub, consts in branches:
        c = _Count()
        _count_jaxpr(sub, c, 1, memo, _bind(sub, operands, known, consts))
        counts.append(c)
    acc.add(max(counts, key=lambda c: (c.flops, c.transcendentals)), mult)


def _count_scan(eqn, acc: _Count, mult: int, memo: _Memo, known: dict) -> None:
    p = eqn.params
    body, consts = jaxpr_and_consts(p["jaxpr"])
    num_consts, num_carry = scan_sizes(eqn)
    length, first_xs = p["length"], num_consts + num_carry
    # Carries change from one iteration to the next: never known.
    args = [
        v if k < num_consts or k >= first_xs else None for k, v in enumerate(eqn.invars)
    ]
    base = _bind(body, [None] * len(args), known, consts)
    for k in range(num_consts):
        x = _value(eqn.invars[k], known)
        if x is not None:
            base[body.invars[k]] = x
    xs = {
        k: x
        for k in range(first_xs, len(args))
        if (x := _value(eqn.invars[k], known)) is not None and x.shape[:1] == (length,)
    }
    deciding = [k for k in xs if k in _control(body, memo)]
    if not deciding:
        _count_jaxpr(body, acc, mult * length, memo, base)
        return
    # Iterations that agree on the values deciding a branch count alike.
    groups: dict = {}
    for t in range(length):
        key = tuple(xs[k][t].tobytes() for k in deciding)
        groups.setdefault(key, [t, 0])[1] += 1
    for t, n in groups.values():
        sub_known = dict(base)
        for k, x in xs.items():
            sub_known[body.invars[k]] = np.asarray(x[t])
        _count_jaxpr(body, acc, mult * n, memo, sub_known)


def _count_while(eqn, acc: _Count, mult: int, memo: _Memo) -> None:
    p = eqn.params
    body, cond = open_jaxpr(p["body_jaxpr"]), open_jaxpr(p["cond_jaxpr"])
    trips = _static_trip_count(eqn)
    if trips is None:
        acc.dynamic_loops += 1
        _count_jaxpr(body, acc, mult, memo)
        _count_jaxpr(cond, acc, mult, memo)
    else:
        _count_jaxpr(body, acc, mult * trips, memo)
        _count_jaxpr(cond, acc, mult * (trips + 1), memo)


def _literal(x: Any) -> int | None:
    """The value of an integer scalar literal, else `None`."""
    if not is_literal(x) or np.ndim(x.val) != 0:
        return None
    val = x.val
    if not np.issubdtype(np.asarray(val).dtype, np.integer):
        return None
    return int(val)


def _static_trip_count(eqn) -> int | None:
    """The trip count of `while i < n: i += 1` with constant `i` and `n` (what
    `lax.fori_loop` builds), else `None`."""
    p = eqn.params
    cond, body = open_jaxpr(p["cond_jaxpr"]), open_jaxpr(p["body_jaxpr"])
    if p["cond_nconsts"] != 0 or len(cond.eqns) != 1:
        return None
    (lt,) = cond.eqns
    if lt.primitive.name != "lt" or lt.outvars[0] != cond.outvars[0]:
        return None
    carry_in = eqn.invars[p["cond_nconsts"] + p["body_nconsts"] :]
    cond_carry = list(cond.invars)
    body_carry = list(body.invars[p["body_nconsts"] :])

    def position(v) -> int | None:
        if is_literal(v):
            return None
        return next((k for k, c in enumerate(cond_carry) if c is v), None)

    i_pos = position(lt.invars[0])
    if i_pos is None:
        return None
    lower = _literal(carry_in[i_pos])
    n_pos = position(lt.invars[1])
    if n_pos is None:
        upper = _literal(lt.invars[1])
    else:
        # the bound must be passed through the body unchanged
        if body.outvars[n_pos] is not body_carry[n_pos]:
            return None
        upper = _literal(carry_in[n_pos])
    if lower is None or upper is None:
        return None
    # the counter must be incremented by one
    inc = body.outvars[i_pos]
    e = None if is_literal(inc) else producers(body).get(inc)
    if (
        e is not None
        and e.primitive.name == "add"
        and len(e.invars) == 2
        and any(v is body_carry[i_pos] for v in e.invars)
        and any(_literal(v) == 1 for v in e.invars)
    ):
        return max(0, upper - lower)
    return None
