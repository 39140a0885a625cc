"""count_flops and memory_report: the instruments every claim is measured with."""

import concurrent.futures
import functools
import json
import math
import os
import pickle
import resource
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import needs_libtpu
from hypothesis import given, strategies as st
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_remat as er
import zoo
from eqx_remat.internal import compiled_report, format_flops


S = jax.ShapeDtypeStruct
f32, bf16 = jnp.float32, jnp.bfloat16


# On TPU v5e, XLA keeps intermediates that fit in on-chip VMEM, and temp bytes
# count HBM only: tiny test programs would report 0. This libtpu flag puts
# every intermediate in HBM, so policies can be compared on small shapes.
NO_VMEM = {"xla_vf_vmem_memory_space_assignment": False}


def xla_cost(fn, *args):
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return cost.get("flops", 0.0), cost.get("transcendentals", 0.0)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1)


# --- count_flops against XLA, on loop-free functions ---------------------------


def _attention(q, k, v):
    s = q @ k.T / math.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((q.shape[0], k.shape[0]), bool))
    s = jnp.where(mask, s, -1e9)
    return jax.nn.softmax(s, axis=-1) @ v


def _mlp(w1, b1, w2, x):
    return jax.nn.gelu(x @ w1 + b1[None]) @ w2


def _conv(x, k, strides=(1, 1), padding="SAME", **kw):
    dn = ("NHWC", "HWIO", "NHWC")
    return lax.conv_general_dilated(x, k, strides, padding, dimension_numbers=dn, **kw)


_x = S((64, 128), f32)
_w1, _b1, _w2 = S((128, 256), f32), S((256,), f32), S((256, 128), f32)
_img, _ker = S((2, 16, 16, 8), f32), S((3, 3, 8, 16), f32)

LOOP_FREE = {
    "dense": (lambda w, b, x: jnp.tanh(x @ w + b[None]), (_w1, _b1, _x)),
    "mlp": (_mlp, (_w1, _b1, _w2, _x)),
    "mlp_grad": (
        jax.grad(lambda *a: _mlp(*a).sum(), argnums=(0, 1, 2)),
        (_w1, _b1, _w2, _x),
    ),
    "attention": (_attention, (_x, _x, _x)),
    "attention_grad": (
        jax.grad(lambda *a: _attention(*a).sum(), argnums=(0, 1, 2)),
        (_x, _x, _x),
    ),
    "conv_same": (_conv, (_img, _ker)),
    "conv_strided_valid": (
        lambda x, k: _conv(x, k, (2, 2), "VALID"),
        (_img, _ker),
    ),
    "conv_dilated": (
        lambda x, k: _conv(x, k, padding=[(2, 2), (1, 1)], rhs_dilation=(2, 1)),
        (_img, _ker),
    ),
    "conv_grouped": (
        lambda x, k: _conv(x, k, feature_group_count=2),
        (_img, S((3, 3, 4, 16), f32)),
    ),
    "conv_grad": (
        jax.grad(lambda x, k: _conv(x, k).sum(), argnums=(0, 1)),
        (_img, _ker),
    ),
    "logsumexp": (lambda x: jax.nn.logsumexp(x, -1), (_x,)),
    "argmax": (lambda x: jnp.argmax(x, -1), (_x,)),
    "pooling": (
        lambda x: lax.reduce_window(
            x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"
        ),
        (_img,),
    ),
}


@pytest.mark.parametrize("name", list(LOOP_FREE), ids=list(LOOP_FREE))
def test_count_flops_matches_xla_on_loop_free_functions(name):
    fn, args = LOOP_FREE[name]
    ours = er.count_flops(fn, *args)
    flops, transcendentals = xla_cost(fn, *args)
    assert flops > 0
    assert rel(ours, flops) < 0.01, (int(ours), flops)
    # XLA constant-folds e.g. the 1/sqrt(d) of attention: allow one.
    assert abs(ours.transcendentals - transcendentals) <= 1
    assert ours.unknown == {}


UNARY = {
    "tanh": jnp.tanh,
    "exp": jnp.exp,
    "log1p": jnp.log1p,
    "sqrt": jnp.sqrt,
    "erf": lax.erf,
    "exp2": jnp.exp2,
    "logistic": jax.nn.sigmoid,
    "erfc": lax.erfc,
    "erf_inv": lambda x: lax.erf_inv(x * 0.5),
    "lgamma": lax.lgamma,
    "sinh": jnp.sinh,
    "integer_pow_5": lambda x: x**5,
    "integer_pow_-3": lambda x: x**-3,
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "where": lambda x: jnp.where(x > 0, x, 0.1 * x),
    "convert": lambda x: x.astype(bf16),
    "reduce_sum_axis": lambda x: x.sum(0),
    "reduce_max": lambda x: x.max(),
    "mean_var": lambda x: x.mean(-1) + (x * x).mean(-1),
}


# What XLA's CPU cost analysis counts for the functions of `UNARY` whose count
# depends on the compiler, per element of `_x`: (FLOPs, transcendentals), by the
# first jaxlib that counts so (a jaxlib uses the newest entry not after it).
# count_flops keeps one convention, jaxlib 0.10.2's (`XLA_COUNTS[0, 10]`, XLA's
# f32 expansion of each function), so that a program's count, and the plans and
# results priced with it, do not change with the jax installed. jaxlib 0.12
# counts these otherwise because it compiles them otherwise, not because the
# work changed: jax 0.12 lowers `exp2` and `sinh` to single HLO operations,
# which XLA counts as one transcendental and no FLOP; it expands `erfc` and
# `erf_inv` with other polynomials; and it lowers `lgamma` to a CPU custom call
# (`cpu_lgamma_ffi`) that cost analysis cannot count (-1 for the program,
# `UNCOUNTED`). (jaxlib 0.11 was not measured: no CI stage runs it.)
UNCOUNTED = "uncounted"
XLA_COUNTS: dict[tuple[int, int], dict[str, Any]] = {
    (0, 10): {
        "exp2": (1, 1),
        "sinh": (10, 3),
        "erfc": (60, 1),
        "erf_inv": (38, 2),  # 37 and the `* 0.5`
        "lgamma": (52, 4),
    },
    (0, 12): {
        "exp2": (0, 1),
        "sinh": (0, 1),
        "erfc": (40, 1),
        "erf_inv": (60, 2),
        "lgamma": UNCOUNTED,
    },
}


def _xla_counts() -> dict[str, Any]:
    """`XLA_COUNTS` of the installed jaxlib."""
    import jaxlib

    installed = tuple(int(p) for p in jaxlib.__version__.split(".")[:2])
    return XLA_COUNTS[max(v for v in XLA_COUNTS if v <= installed)]


@pytest.mark.parametrize("name", list(UNARY), ids=list(UNARY))
def test_count_flops_primitive_conventions_match_xla(name):
    """count_flops counts each primitive as XLA's cost analysis does; where
    XLA's count depends on its version (`XLA_COUNTS`), this XLA gives its
    version's figure and count_flops the figure of jaxlib 0.10.2, its one
    convention."""
    fn = UNARY[name]
    ours = er.count_flops(fn, _x)
    flops, transcendentals = xla_cost(fn, _x)
    if name not in XLA_COUNTS[0, 10]:
        assert (int(ours), ours.transcendentals) == (flops, transcendentals)
        return
    n = math.prod(_x.shape)
    now = _xla_counts()[name]
    if now == UNCOUNTED:
        assert (flops, transcendentals) == (-1, 0)
    else:
        assert (flops, transcendentals) == (now[0] * n, now[1] * n)
    kept = XLA_COUNTS[0, 10][name]
    assert (int(ours), ours.transcendentals) == (kept[0] * n, kept[1] * n)


@given(
    batch=st.sampled_from([(), (1,), (3,)]),
    m=st.integers(1, 40),
    # XLA's CPU backend pads a full reduction of more than 32 elements (the
    # m = n = 1 case) to a multiple of 32 in its count: stay below that.
    k=st.integers(1, 32),
    n=st.integers(1, 40),
    length=st.integers(1, 6),
)
def test_count_flops_dense_any_shape_and_scanned(batch, m, k, n, length):
    """Any (batched) matmul shape, including XLA's simplified cases (k = 1,
    m = n = 1), agrees with XLA; scanning it `length` times multiplies it."""
    x, w = S((*batch, m, k), f32), S((*batch, k, n), f32)
    dense = lambda x, w: jnp.tanh(x @ w)
    ours = er.count_flops(dense, x, w)
    flops, transcendentals = xla_cost(dense, x, w)
    assert (int(ours), ours.transcendentals) == (flops, transcendentals)
    ws = S((length, *batch, k, k), f32)
    scanned = er.count_flops(
        lambda ws, x: lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0],
        ws,
        S((*batch, m, k), f32),
    )
    one = er.count_flops(dense, S((*batch, m, k), f32), S((*batch, k, k), f32))
    assert int(scanned) == length * int(one)
    assert scanned.transcendentals == length * one.transcendentals


# --- loops, control flow, recomputation -----------------------------------------


def _layer(c, w):
    return jnp.tanh(c @ w)


def test_count_flops_scan_is_length_times_body():
    ws, c = S((7, 32, 32), f32), S((16, 32), f32)
    body = er.count_flops(_layer, c, S((32, 32), f32))
    scan = er.count_flops(
        lambda ws, c: lax.scan(lambda c, w: (_layer(c, w), None), c, ws)[0], ws, c
    )
    assert body > 0
    assert int(scan) == 7 * body
    assert scan.transcendentals == 7 * body.transcendentals
    # XLA counts the body once: that's why count_flops exists.
    flops, _ = xla_cost(
        lambda ws, c: lax.scan(lambda c, w: (_layer(c, w), None), c, ws)[0], ws, c
    )
    assert rel(flops, body) < 0.01


def test_count_flops_nested_scan_and_fori_loop():
    c, w = S((16, 32), f32), S((32, 32), f32)
    body = er.count_flops(_layer, c, w)

    def nested(c, w):
        inner = lambda c, _: (_layer(c, w), None)
        outer = lambda c, _: (lax.scan(inner, c, None, length=3)[0], None)
        return lax.scan(outer, c, None, length=5)[0]

    assert int(er.count_flops(nested, c, w)) == 15 * body

    # Constant bounds as arrays make a `while` loop with a static trip count:
    # 5 bodies, plus 5 counter increments and 6 comparisons.
    def fori(c, w):
        return lax.fori_loop(jnp.int32(2), jnp.int32(7), lambda i, c: _layer(c, w), c)

    assert jax.make_jaxpr(fori)(c, w).eqns[0].primitive.name == "while"
    n = er.count_flops(fori, c, w)
    assert int(n) == 5 * body + 5 + 6
    assert n.dynamic_loops == 0


def test_count_flops_dynamic_while_counts_body_once_and_says_so():
    c, w = S((16, 32), f32), S((32, 32), f32)
    body = er.count_flops(_layer, c, w)
    n = er.count_flops(
        lambda c, w, k: lax.fori_loop(0, k, lambda i, c: _layer(c, w), c),
        c,
        w,
        S((), jnp.int32),
    )
    assert n.dynamic_loops == 1
    assert body <= n < 2 * body


def test_count_flops_cond_counts_the_most_expensive_branch():
    c, w = S((16, 32), f32), S((32, 32), f32)
    body = er.count_flops(_layer, c, w)
    n = er.count_flops(
        lambda p, c, w: lax.cond(p, lambda: _layer(c, w), lambda: c),
        S((), jnp.bool_),
        c,
        w,
    )
    assert body <= n <= body + 2


@pytest.mark.parametrize("depth", [1, 4], ids=["depth1", "depth4"])
def test_count_flops_counts_recomputation_of_checkpoint(depth):
    """With "nothing", the backward pass re-runs every layer's forward: a tanh
    MLP's gradient costs exactly one more forward pass of its layers."""
    layers = er.stack(
        lambda k: _Tanh(eqx.nn.Linear(32, 32, key=k)),
        jax.random.split(jax.random.key(0), depth),
    )
    x = jnp.ones((32,))

    def forward(layers, x, checkpoint=None):
        return er.scan_layers(layers, x, checkpoint=checkpoint)

    def grad(checkpoint):
        loss = lambda layers, x: forward(layers, x, checkpoint).sum()
        return er.count_flops(eqx.filter_grad(loss), layers, x)

    fwd = er.count_flops(forward, layers, x)
    plain, nothing, dots = grad(None), grad("nothing"), grad("dots")
    assert int(nothing) - int(plain) == int(fwd)
    assert nothing.transcendentals - plain.transcendentals == fwd.transcendentals
    # "dots" saves the matmuls: it recomputes only the elementwise work.
    assert plain <= dots < nothing
    assert dots.transcendentals == nothing.transcendentals


class _Tanh(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, c):
        return jnp.tanh(self.lin(c))


def test_count_flops_custom_vjp_forward_and_backward():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x) * 2

    f.defvjp(lambda x: (f(x), x), lambda x, g: (g * jnp.cos(x) * 3 * x,))
    x = S((8, 16), f32)
    n = 8 * 16
    fwd = er.count_flops(f, x)
    assert (int(fwd), fwd.transcendentals) == (n, n)  # the primal, as traced
    bwd = er.count_flops(jax.grad(lambda x: f(x).sum()), x)
    # The bwd rule only: ones * cos(x) (t), * 3, * x. The forward's output is
    # not used by the gradient, so it is dead code, dropped as XLA drops it.
    assert (int(bwd), bwd.transcendentals) == (3 * n, n)


def test_count_flops_schedules_count_recomputation():
    layers = er.stack(
        lambda k: _Tanh(eqx.nn.Linear(16, 16, key=k)),
        jax.random.split(jax.random.key(0), 8),
    )
    x = jnp.ones((16,))

    def cost(checkpoint):
        loss = lambda ls, x: er.scan_layers(ls, x, checkpoint=checkpoint).sum()
        return er.count_flops(eqx.filter_grad(loss), layers, x)

    plain = cost(None)
    fwd = er.count_flops(lambda ls, x: er.scan_layers(ls, x), layers, x)
    for schedule in [er.every(2), er.recursive()]:
        n = cost(schedule)
        assert n.unknown == {}
        assert plain < n <= plain + 3 * fwd


def test_count_flops_unknown_primitives_are_listed():
    x = S((4, 8), f32)
    n = er.count_flops(lambda x: jnp.sort(x) * 2, x)
    assert int(n) == 32
    assert n.unknown == {"sort": 1}
    in_scan = er.count_flops(
        lambda x: lax.scan(lambda c, _: (jnp.sort(c), None), x, None, length=3)[0], x
    )
    assert in_scan.unknown == {"sort": 3}
    rng = er.count_flops(lambda k: jax.random.normal(k, (4,)), jax.random.key(0))
    assert "random_bits" in rng.unknown


def test_count_flops_pytrees_modules_and_shape_dtype_structs():
    mlp = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))  # holds functions too
    x = jnp.ones((8,))
    n = er.count_flops(lambda m, x: m(x), mlp, x)
    assert n == er.count_flops(lambda m, x: m(x), mlp, S((8,), f32))
    # 8x16 + 16x16 + 16x4 matmuls, 2 * in * out each, + biases, + relus
    assert int(n) >= 2 * (8 * 16 + 16 * 16 + 16 * 4)
    big = S((2**20, 2**14), f32)  # 64 GiB: traced, never allocated
    assert int(er.count_flops(lambda w: w.sum(), big)) == 2**34 - 1


def test_flop_count_is_an_int_with_details():
    n = er.count_flops(lambda x: jnp.sort(jnp.tanh(x)), S((3,), f32))
    assert isinstance(n, int) and isinstance(n, er.FlopCount)
    assert n == 0 and n + 1 == 1 and type(n + 1) is int
    assert n.transcendentals == 3
    assert json.loads(json.dumps(n.to_dict())) == {
        "flops": 0,
        "transcendentals": 3,
        "unknown": {"sort": 1},
        "dynamic_loops": 0,
        "dot_bytes": 0,
    }
    assert "unknown={'sort': 1}" in repr(n)
    m = pickle.loads(pickle.dumps(n))
    assert m == n and m.unknown == n.unknown


def test_count_flops_is_re_entrant_and_thread_safe():
    """Each call owns what it memoises: counting inside a function being counted,
    and counting in several threads at once, give the counts of one call alone."""
    layers = er.stack(
        lambda k: _Tanh(eqx.nn.Linear(8, 8, key=k)),
        jax.random.split(jax.random.key(0), 12),
    )
    x = jnp.ones((8,))

    def grad(checkpoint):
        loss = lambda ls, x: er.scan_layers(ls, x, checkpoint=checkpoint).sum()
        return eqx.filter_grad(loss)

    schedules = [er.binomial(3), er.recursive(), er.every(4), None]
    alone = [er.count_flops(grad(c), layers, x) for c in schedules]
    assert len(set(alone)) == len(alone)  # the schedules differ
    inner = []

    def outer(ls, x):
        inner.append(er.count_flops(grad(er.binomial(3)), ls, x))
        return grad(er.recursive())(ls, x)

    assert er.count_flops(outer, layers, x) == alone[1]
    assert inner == [alone[0]]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        counts = list(
            pool.map(lambda c: er.count_flops(grad(c), layers, x), schedules * 2)
        )
    assert counts == alone * 2
    assert [n.unknown for n in counts] == [{}] * len(counts)


def _pallas_double(name=None, estimate=None):
    """A Pallas kernel (interpreted, so it runs on the CPU) computing `2 x`."""
    from jax.experimental import pallas as pl

    def double_kernel(x_ref, o_ref, *, factor):
        o_ref[...] = x_ref[...] * factor

    return pl.pallas_call(
        functools.partial(double_kernel, factor=2.0),
        out_shape=S((8, 128), f32),
        interpret=True,
        name=name,
        cost_estimate=estimate,
    )


def test_with_pallas_costs_gives_kernels_without_one_an_estimate():
    from jax.experimental import pallas as pl

    from eqx_remat.internal import with_pallas_costs

    estimate = pl.CostEstimate(flops=1000, transcendentals=7, bytes_accessed=0)
    kept = pl.CostEstimate(flops=5, transcendentals=0, bytes_accessed=0)

    def fn(x, y):
        # A kernel named by its function, three times in a scan inside a jit;
        # one named by `name=`; one with its own estimate, which it keeps.
        step = lambda c, _: (_pallas_double()(c), None)
        a = jax.jit(lambda x: lax.scan(step, x, None, length=3)[0])(x)
        return {"a": a, "b": _pallas_double("twice")(y) + _pallas_double(None, kept)(y)}

    x, y = jnp.ones((8, 128)), jnp.full((8, 128), 3.0)
    bare = er.count_flops(fn, x, y)
    assert bare.unknown == {"pallas_call": 4}
    costs = {"double_kernel": estimate, "twice": estimate}
    wrapped = with_pallas_costs(fn, costs)
    n = er.count_flops(wrapped, x, y)
    assert n.unknown == {}
    assert int(n) == int(bare) + 4 * 1000 and n.transcendentals == 4 * 7
    assert jax.tree.map(float, jax.tree.map(jnp.max, wrapped(x, y))) == {
        "a": 8.0,
        "b": 12.0,
    }


def test_with_pallas_costs_rejects_names_it_cannot_find():
    from jax.experimental import pallas as pl

    from eqx_remat.internal import with_pallas_costs

    estimate = pl.CostEstimate(flops=1, transcendentals=0, bytes_accessed=0)
    x = jnp.ones((8, 128))
    wrapped = with_pallas_costs(_pallas_double("twice"), {"thrice": estimate})
    with pytest.raises(
        ValueError, match=r"\['thrice'\].*calls the kernels \['twice'\]"
    ):
        wrapped(x)
    with pytest.raises(TypeError, match="CostEstimate. Got {'twice': 1}"):
        with_pallas_costs(_pallas_double("twice"), {"twice": 1})


# --- memory_report on the default backend ----------------------------------------


def _grad_fn():
    def loss(w, x):
        h = jnp.tanh(x @ w)
        return jnp.tanh(h @ w.T).sum()

    return jax.grad(loss)


def test_memory_report_equals_memory_analysis():
    w, x = jnp.ones((64, 64)), jnp.ones((128, 64))
    fn = _grad_fn()
    direct = jax.jit(fn).lower(w, x).compile().memory_analysis()
    for args in [(w, x), (S(w.shape, w.dtype), S(x.shape, x.dtype))]:
        r = er.memory_report(fn, *args)
        assert r.temp_bytes == direct.temp_size_in_bytes > 0
        assert r.argument_bytes == direct.argument_size_in_bytes
        assert r.output_bytes == direct.output_size_in_bytes
        assert r.host_temp_bytes == direct.host_temp_size_in_bytes
        assert r.flops == er.count_flops(fn, w, x) > 0
        assert r.target == jax.default_backend()
        assert isinstance(r.flops, er.FlopCount) and r.flops.dynamic_loops == 0
        in_device = ("temp", "argument", "output")
        assert r.total_bytes == sum(
            getattr(direct, f"{k}_size_in_bytes") for k in in_device
        )
        compiled = jax.jit(fn).lower(w, x).compile()
        same = compiled_report(compiled, flops=r.flops, target=r.target)
        assert same == r


@pytest.mark.parametrize(
    "n, expected",
    [
        (0, "0"),
        (999, "999"),
        (1500, "1.5 k"),
        (2_000_000, "2 M"),
        (3.2e12, "3.2 T"),
        (2.5e15, "2.5 P"),
        (4.5e18, "4.5e+03 P"),
    ],
)
def test_format_flops(n, expected):
    assert format_flops(n) == expected


def test_memory_report_str_and_dict():
    r = er.memory_report(_grad_fn(), S((64, 64), f32), S((128, 64), f32))
    line = str(r)
    assert "\n" not in line
    assert "MiB" in line and "GFLOPs" in line and r.target in line
    d = json.loads(json.dumps(r.to_dict()))
    assert d == r._asdict()
    assert set(d) == {
        "temp_bytes",
        "argument_bytes",
        "output_bytes",
        "host_temp_bytes",
        "flops",
        "target",
        "collective_bytes",
        "network_bytes",
    }


def test_memory_report_takes_modules_and_drops_static_outputs():
    mlp = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))
    loss = lambda m, x: jnp.sum(m(x) ** 2)
    r = er.memory_report(eqx.filter_grad(loss), mlp, S((8,), f32))
    params = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(mlp, eqx.is_array)))
    assert r.argument_bytes == params + 8 * 4
    # the gradients, and XLA's table of the output tuple (8 bytes per output)
    assert r.output_bytes == params + 8 * 6


def test_memory_report_ten_gib_of_parameters_without_allocating():
    w = S((2**16, 40960), f32)  # 10 GiB
    x = S((4, 2**16), f32)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    r = er.memory_report(lambda w, x: x @ w[:, :128], w, x)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert r.argument_bytes >= 10 * 2**30
    assert r.flops == 2 * 4 * 2**16 * 128
    assert (after - before) * 1024 < 2**30  # nothing near 10 GiB was touched


def _offload_loss(w, x, policy):
    def layer(c, w):
        return jnp.tanh(checkpoint_name(jnp.tanh(c @ w), "h") @ w)

    f = jax.checkpoint(layer, policy=policy)
    return lax.scan(lambda c, w: (f(c, w), None), x, w)[0].sum()


def _said(*reports_of):
    """Each report, and the `OffloadWarning`s said while it was made."""
    out = []
    for report_of in reports_of:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", er.OffloadWarning)
            report = report_of()
        out.append(
            (report, [str(w.message) for w in said if w.category is er.OffloadWarning])
        )
    return out


def test_memory_report_cpu_cannot_measure_offload():
    """On the CPU there is one memory: offloaded values stay where they are. The
    report shows no host memory and the temp bytes of saving the same values,
    and says that such an offload does not pay, naming the policy."""
    args = S((4, 64, 64), f32), S((128, 64), f32)
    grad = lambda pol: jax.grad(lambda *a: _offload_loss(*a, pol))
    (save, quiet), (off, said) = _said(
        lambda: er.memory_report(grad(er.save_names("h")), *args),
        lambda: er.memory_report(grad(er.offload_names("h")), *args),
    )
    assert off.host_temp_bytes == 0
    assert off.temp_bytes == save.temp_bytes
    assert quiet == []
    # A jax.checkpoint of the caller's own has no save-on-device twin: said only
    # because it moves nothing.
    assert len(said) == 1 and "moves no bytes to the host" in said[0]
    assert "not an eqx_remat checkpoint's" in said[0]


@pytest.mark.parametrize(
    "offloading, saving",
    [
        (er.offload_names("h"), er.save_names("h")),
        ("offload_dots_no_batch", "dots_no_batch"),
        (er.every(2, er.offload_names("h")), er.every(2, er.save_names("h"))),
        (
            er.ranges((2, er.offload_names("h")), (2, "dots")),
            er.ranges((2, er.save_names("h")), (2, "dots")),
        ),
    ],
    ids=["offload_names", "offload_dots_no_batch", "every", "ranges"],
)
def test_memory_report_says_an_offload_that_does_not_pay(offloading, saving):
    """An eqx_remat checkpoint that offloads, as a field of the arguments: its
    save-on-device twin is compiled beside it. On the CPU nothing moves to the
    host, so the warning names the policy and gives the temp bytes of both,
    those of the twin being the saving checkpoint's. The checkpoint that saves
    is compiled once and warns nothing."""

    class Layer(eqx.Module):
        w: jax.Array

        def __call__(self, c):
            return jnp.tanh(checkpoint_name(jnp.tanh(c @ self.w), "h") @ self.w)

    class Stack(eqx.Module):
        layers: Layer
        checkpoint: Any = eqx.field(static=True)

        def __call__(self, x):
            return er.scan_layers(self.layers, x, checkpoint=self.checkpoint)

    grad = eqx.filter_grad(lambda m, x: m(x).sum())
    layers = Layer(S((4, 64, 64), f32))
    x = S((128, 64), f32)
    (save, quiet), (off, said) = _said(
        lambda: er.memory_report(grad, Stack(layers, saving), x),
        lambda: er.memory_report(grad, Stack(layers, offloading), x),
    )
    assert quiet == [] and len(said) == 1
    assert off.host_temp_bytes == 0 and off.temp_bytes == save.temp_bytes
    named = repr(
        er.POLICIES[offloading]
        if isinstance(offloading, str)
        else er.offload_names("h")  # in a schedule or range too
    )
    assert f"offloading with {named} does not pay on cpu" in said[0]
    assert f"({er.format_bytes(off.temp_bytes)} of device memory" in said[0]
    assert f"against {er.format_bytes(save.temp_bytes)} when saving" in said[0]


def test_offload_fails_is_the_rule_on_compiled_figures():
    """The one rule: an offload pays where it moves bytes to the host and keeps
    fewer temp bytes on the device than saving; otherwise the reason names
    both figures."""
    from eqx_remat.internal import offload_fails

    saving = er.MemoryReport(2605056, 10, 10, 0, 1, "v5e:2x2")
    pays = saving._replace(temp_bytes=2000000, host_temp_bytes=786432)
    assert offload_fails(pays, saving) is None
    more = saving._replace(temp_bytes=2981888, host_temp_bytes=786432)
    same = saving._replace(host_temp_bytes=786432)
    nothing = saving._replace(temp_bytes=2000000)
    for off in (more, same):
        why = offload_fails(off, saving)
        assert why is not None and "moves 768.00 KiB to the host" in why
        assert f"keeps {er.format_bytes(off.temp_bytes)} of device memory" in why
        assert "against 2.48 MiB when saving on the device" in why
    why = offload_fails(nothing, saving)
    assert why is not None and why.startswith("it moves no bytes to the host")


@pytest.mark.parametrize(
    "target", ["v4", "CPU", "v5e:2", "v5e:2x2x1", "V5E", "v5e:0x2"]
)
def test_memory_report_unknown_target(target):
    with pytest.raises(ValueError, match='Unknown target.*None.*"cpu".*"v5e".*v5e:AxB'):
        er.memory_report(jnp.sin, S((2,), f32), target=target)


def test_memory_report_accepts_the_platform_name_it_reports():
    default = er.memory_report(jnp.sin, S((2,), f32))
    assert default.target == jax.default_backend()
    assert er.memory_report(jnp.sin, S((2,), f32), target=default.target) == default
    other = next(p for p in ("cpu", "gpu", "tpu") if p != jax.default_backend())
    with pytest.raises(ValueError, match=f"target='{other}'.*default backend"):
        er.memory_report(jnp.sin, S((2,), f32), target=other)


def test_memory_report_without_libtpu_names_the_tpu_extra():
    """In a fresh interpreter where libtpu cannot be imported, target="v5e" fails
    with the install command; the default target still works."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["libtpu"] = None  # `import libtpu` now fails: not installed
        try:
            import libtpu  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("libtpu still importable")
        import jax, jax.numpy as jnp
        import eqx_remat
        x = jax.ShapeDtypeStruct((4,), jnp.float32)
        print("default", eqx_remat.memory_report(jnp.sin, x).target)
        try:
            eqx_remat.memory_report(jnp.sin, x, target="v5e")
        except ImportError as e:
            print("error", e)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TPU_LIBRARY_PATH"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "default cpu" in out.stdout
    assert "error" in out.stdout
    assert "pip install 'eqx-remat[tpu]'" in out.stdout


# --- TPU v5e, compiled ahead of time --------------------------------------------


class Block(eqx.Module):
    """A transformer-like layer: causal attention + MLP, on `(batch, seq, d)`."""

    wqkv: jax.Array
    wo: jax.Array
    w1: jax.Array
    w2: jax.Array
    heads: int = eqx.field(static=True)

    def __call__(self, x):
        b, s, d = x.shape
        h = self.heads

        def norm(x):
            x32 = x.astype(f32)
            return (
                x32 * lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
            ).astype(x.dtype)

        qkv = checkpoint_name(norm(x) @ self.wqkv, "qkv_proj")
        q, k, v = jnp.split(qkv.reshape(b, s, 3 * h, d // h), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(f32) / math.sqrt(d // h)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
        p = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, d)
        x = x + checkpoint_name(ctx @ self.wo, "out_proj")
        hidden = checkpoint_name(jax.nn.gelu(norm(x) @ self.w1), "mlp_hidden")
        return x + checkpoint_name(hidden @ self.w2, "mlp_out")


def stacked_blocks(depth, d, heads, dtype):
    return Block(
        wqkv=S((depth, d, 3 * d), dtype),
        wo=S((depth, d, d), dtype),
        w1=S((depth, d, 4 * d), dtype),
        w2=S((depth, 4 * d, d), dtype),
        heads=heads,
    )


def train_grad(checkpoint):
    def loss(blocks, x):
        out = er.scan_layers(blocks, x, checkpoint=checkpoint)
        return jnp.mean(out.astype(f32) ** 2)

    return jax.grad(loss)


@needs_libtpu
def test_v5e_mesh_and_sharded_arguments():
    mesh = er.v5e_mesh()
    assert mesh.axis_names == ("data",) and mesh.size == 4
    assert er.v5e_mesh("v5e") is mesh is er.v5e_mesh("v5e:2x2")  # cached
    assert er.v5e_mesh("v5e:2x4").size == 8
    fn = lambda w, x: jnp.tanh(x @ w)
    w = S((256, 256), f32)
    with pytest.warns(er.ReplicatedArgumentsWarning, match="replicated on each of"):
        replicated = er.memory_report(fn, w, S((64, 256), f32), target="v5e")
    sharded = er.memory_report(
        fn, w, S((64, 256), f32, sharding=NamedSharding(mesh, P("data"))), target="v5e"
    )
    assert replicated.target == sharded.target == "v5e:2x2"
    # per chip: all of w, and a quarter of the batch
    assert sharded.argument_bytes == 256 * 256 * 4 + 16 * 256 * 4
    assert replicated.argument_bytes == 256 * 256 * 4 + 64 * 256 * 4
    assert sharded.output_bytes == 16 * 256 * 4
    # the whole program's FLOPs (tanh is a transcendental, not a FLOP)
    assert sharded.flops == replicated.flops == 2 * 64 * 256 * 256
    with pytest.raises(ValueError, match="v5e_mesh"):
        er.memory_report(
            fn,
            w,
            S((64, 256), f32, sharding=NamedSharding(er.v5e_mesh("v5e:2x4"), P())),
            target="v5e",
        )


@needs_libtpu
def test_v5e_mesh_of_data_and_fsdp_axes():
    """`fsdp=k` splits the slice's chips into `("data", "fsdp")` of `n / k` and
    `k`: the same chips, and a weight split over `"fsdp"` is that much per chip."""
    one = er.v5e_mesh("v5e:2x4")
    for k in (1, 2, 4, 8):
        mesh = er.v5e_mesh("v5e:2x4", fsdp=k)
        assert mesh.axis_names == ("data", "fsdp")
        assert dict(mesh.shape) == {"data": 8 // k, "fsdp": k}
        assert set(mesh.devices.flat) == set(one.devices.flat)
    assert er.v5e_mesh("v5e:2x4", fsdp=2) is er.v5e_mesh("v5e:2x4", fsdp=2)
    mesh = er.v5e_mesh("v5e:2x4", fsdp=4)
    fn = lambda w, x: jnp.tanh(x @ w)
    w = S((256, 256), f32, sharding=NamedSharding(mesh, P("fsdp")))
    x = S((64, 256), f32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
    report = er.memory_report(fn, w, x, target="v5e:2x4")
    assert report.argument_bytes == 256 * 256 * 4 // 4 + 8 * 256 * 4
    assert report.collective_bytes > 0  # w gathered over "fsdp"
    for bad in (3, 0, True):
        with pytest.raises(ValueError, match="v5e_mesh.*fsdp"):
            er.v5e_mesh("v5e:2x4", fsdp=bad)
    # Every split of a 16x16 slice, 128 of which is no product of its physical
    # axes (16 x 16): a physical axis is split, as MaxText allows.
    meshes = er.internal.mesh_splits("v5e:16x16")
    assert [m.shape["fsdp"] for m in meshes] == [256, 128, 64, 32, 16, 8, 4, 2, 1]
    assert all(len(set(m.devices.flat)) == 256 for m in meshes)


@needs_libtpu
def test_v5e_mesh_of_a_tensor_axis():
    """`tensor=t` adds a third axis, `"tensor"` (MaxText's
    `ici_tensor_parallelism`): `("data", "fsdp", "tensor")` over the same chips;
    `fsdp x tensor` must divide a slice."""
    one = er.v5e_mesh("v5e:2x4")
    mesh = er.v5e_mesh("v5e:2x4", fsdp=2, tensor=2)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert set(mesh.devices.flat) == set(one.devices.flat)
    only = er.v5e_mesh("v5e:2x4", tensor=4)
    assert dict(only.shape) == {"data": 2, "fsdp": 1, "tensor": 4}
    with pytest.raises(ValueError, match=r"fsdp x tensor.*Got fsdp=4, tensor=4"):
        er.v5e_mesh("v5e:2x4", fsdp=4, tensor=4)
    with pytest.raises(ValueError, match="v5e_mesh.*tensor"):
        er.v5e_mesh("v5e:2x4", fsdp=2, tensor=0)


@needs_libtpu
def test_an_offload_whose_twin_does_not_fit_pays():
    """On v5e the save-on-device twin of an offloading program may not fit at
    all (XLA refuses it, RESOURCE_EXHAUSTED): then offloading pays, the report
    is the offloading program's, and nothing is said."""

    class Layer(eqx.Module):
        up: jax.Array
        down: jax.Array

        def __call__(self, c):
            return jnp.tanh(checkpoint_name(c @ self.up, "h")) @ self.down

    def loss(layers, x):
        return er.scan_layers(layers, x, checkpoint=er.offload_names("h")).sum()

    mesh = er.v5e_mesh()
    # Eight layers of 2 GiB per chip saved: 16 GiB, more than a chip holds.
    replicated = NamedSharding(mesh, P())
    layers = Layer(
        S((8, 64, 512), f32, sharding=replicated),
        S((8, 512, 64), f32, sharding=replicated),
    )
    x = S((2**22, 64), f32, sharding=NamedSharding(mesh, P("data")))
    ((report, said),) = _said(
        lambda: er.memory_report(eqx.filter_grad(loss), layers, x, target="v5e")
    )
    assert said == []
    assert report.host_temp_bytes >= 7 * 2**31  # the residuals, on the host
    assert report.total_bytes < 15.75 * 2**30


@needs_libtpu
def test_v5e_mesh_of_several_slices():
    """`"Nxv5e:AxB"`: N slices, the data axis spanning them slice after slice
    and FSDP within one; a gradient all-reduced over the data axis sends over
    the data center network (`network_bytes`), which one slice never does."""
    assert er.internal.slice_count("2xv5e:2x2") == 2
    assert er.internal.slice_count("v5e:2x2") == 1
    assert er.internal.slice_shape("2xv5e:2x4") == (2, 4)
    mesh = er.v5e_mesh("2xv5e:2x2")
    assert dict(mesh.shape) == {"data": 8}
    assert [d.slice_index for d in mesh.devices.flat] == [0] * 4 + [1] * 4
    mesh = er.v5e_mesh("2xv5e:2x2", fsdp=4)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
    for i, row in enumerate(mesh.devices):
        assert {d.slice_index for d in row} == {i}  # FSDP within a slice
    meshes = er.internal.mesh_splits("2xv5e:2x2")
    assert [dict(m.shape) for m in meshes] == [
        {"data": 2, "fsdp": 4},
        {"data": 4, "fsdp": 2},
        {"data": 8, "fsdp": 1},
    ]
    with pytest.raises(ValueError, match="fsdp to divide the 4 chips of each slice"):
        er.v5e_mesh("2xv5e:2x2", fsdp=8)
    with pytest.raises(ValueError, match="N >= 1"):
        er.v5e_mesh("0xv5e:2x2")

    def grad(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)

    def report(target):
        m = er.v5e_mesh(target)
        w = S((256, 256), f32, sharding=NamedSharding(m, P()))
        x = S((64, 256), f32, sharding=NamedSharding(m, P("data")))
        return er.memory_report(grad, w, x, target=target)

    two, one = report("2xv5e:2x2"), report("v5e:2x4")
    assert two.target == "2xv5e:2x2" and one.network_bytes == 0
    # The 256 KiB gradient, or a slice's share of it, all-reduced between the
    # two slices: each chip sends (2 - 1) / 2 of it twice.
    assert 256 * 256 * 4 // 4 <= two.network_bytes <= 256 * 256 * 4
    assert two.collective_bytes < one.collective_bytes  # less within a slice


@needs_libtpu
@pytest.mark.heavy
def test_flash_attention_is_traced_on_the_arguments_mesh():
    """zoo's flash kernel runs under `shard_map` on the mesh it is traced on:
    with the arguments on a `("data", "fsdp")` mesh of the target's chips,
    `memory_report` and `roofline_seconds` trace on theirs, not the target's
    one-axis mesh (whose axes lack "fsdp")."""
    mesh = er.v5e_mesh("v5e", fsdp=2)
    make = lambda: zoo.Transformer.llama(
        vocab_size=256,
        max_len=256,
        d_model=256,
        num_heads=2,
        num_layers=2,
        attention="flash",
        key=jax.random.key(0),
    )
    model = zoo.shard(eqx.filter_eval_shape(make), mesh, fsdp=True, axis="fsdp")
    tokens = S((4, 256), jnp.int32)
    tokens = zoo.shard_batch(tokens, mesh, axis=("data", "fsdp"))

    def loss(m, t):
        out = jax.vmap(m, spmd_axis_name=("data", "fsdp"))(t)
        return jnp.mean(out.astype(f32))

    grad = lambda m, t: zoo.shard(
        eqx.filter_grad(loss)(m, t), mesh, fsdp=True, axis="fsdp"
    )
    report = er.memory_report(grad, model, tokens, target="v5e")
    assert report.flops > 0 and report.collective_bytes > 0
    assert er.internal.roofline_seconds(grad, model, tokens, target="v5e") > 0


@needs_libtpu
def test_v5e_leaves_the_environment_as_it_was():
    """libtpu reads `TPU_*` variables when it loads: memory_report sets those the
    user has not set only while it loads, and restores the environment after —
    compiling later, for another slice shape too, needs none of them. Run in a
    fresh interpreter, where libtpu is not loaded yet."""
    script = textwrap.dedent(
        """
        import os
        import jax, jax.numpy as jnp
        import eqx_remat as er

        before = dict(os.environ)
        x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
        fn = lambda x: jnp.tanh(x @ x.T)
        reports = [er.memory_report(fn, x, target=t) for t in ("v5e", "v5e:2x4")]
        changed = set(os.environ.items()) ^ set(before.items())
        print("changed", sorted(changed))
        print("targets", [r.target for r in reports], int(reports[0].flops))
        """
    )
    ours = {
        "TPU_ACCELERATOR_TYPE",
        "TPU_WORKER_HOSTNAMES",
        "TPU_SKIP_MDS_QUERY",
        "ALLOW_MULTIPLE_LIBTPU_LOAD",
    }
    env = {k: v for k, v in os.environ.items() if k not in ours}
    env["JAX_PLATFORMS"] = "cpu"
    env["TPU_WORKER_HOSTNAMES"] = "localhost"  # the user's own: kept
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "changed []" in out.stdout
    assert f"targets ['v5e:2x2', 'v5e:2x4'] {2 * 64 * 64 * 256}" in out.stdout


@needs_libtpu
def test_v5e_is_quiet_and_warns_once_at_the_users_line(tmp_path):
    """The README's first snippet on a CPU machine with libtpu installed: JAX's
    first backend use loads libtpu, which must print none of its start-up errors
    ("could not determine TPU accelerator type", "unexpected worker hostname");
    one `memory_report` call with replicated arguments warns once, at the
    user's line (not `sys:1`)."""
    script = tmp_path / "snippet.py"
    script.write_text(
        textwrap.dedent(
            """
            import jax, jax.numpy as jnp
            import eqx_remat as er
            x = jnp.ones((64, 256))  # the first backend use: libtpu loads here
            fn = lambda x: jnp.tanh(x @ x.T)
            print(er.memory_report(fn, x, target="v5e").target)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    env.pop("JAX_PLATFORMS", None)  # as a user runs it: JAX picks the backend
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(er.__file__))
    out = subprocess.run(
        [sys.executable, "-W", "default", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["v5e:2x2"]
    for noise in ("accelerator type", "worker hostname", "Source Location", "E0000"):
        assert noise not in out.stderr, out.stderr
    assert out.stderr.count(": ReplicatedArgumentsWarning:") == 1, out.stderr
    assert f"{script}:6: ReplicatedArgumentsWarning" in out.stderr, out.stderr


@pytest.mark.parametrize("target", ["v5e:3x3", "v5e:2x3", "v5e:4x2"])
def test_v5e_slice_shapes_are_those_v5e_comes_in(target):
    # libtpu describes a 2x3 slice, which no one can run on.
    with pytest.raises(ValueError, match="comes in slices of 1x1, 2x2, 2x4.*v5e:AxB"):
        er.memory_report(jnp.sin, S((2,), f32), target=target)


@pytest.mark.parametrize(
    "target", ["v5p:2x2", "v5p:3x4x4", "v5p:4x4x6", "v6e:2x3", "v6e:2x2x1"]
)
def test_v5p_and_v6e_slice_shapes_are_those_they_come_in(target):
    with pytest.raises(ValueError, match=r"TPU v(5p|6e) comes in slices of"):
        er.memory_report(jnp.sin, S((2,), f32), target=target)


def test_a_targets_generation_is_read_by_the_one_parser():
    generation = er.internal.slice_generation
    assert [generation(t) for t in ("v5e", "2xv5p:4x4x4", "v6e:2x4")] == [
        "v5e",
        "v5p",
        "v6e",
    ]
    assert generation("cpu") is None and generation("v7x:2x2") is None


@needs_libtpu
@pytest.mark.parametrize(
    "target, shape, chips, kind",
    [
        ("v5p", (2, 2, 1), 4, "TPU v5"),
        ("v5p:4x4x4", (4, 4, 4), 64, "TPU v5"),
        ("2xv5p:2x2x2", (2, 2, 2), 16, "TPU v5"),
        ("v6e:2x4", (2, 4), 8, "TPU v6 lite"),
    ],
)
def test_v5p_and_v6e_targets_compile_for_their_chips(target, shape, chips, kind):
    """A v5p or v6e target is a slice of that TPU: its chips (a v5p-128 is 64
    chips: v5p names count TensorCores), their figures and per-chip memory,
    compiled ahead of time as v5e's are."""
    assert er.internal.slice_shape(target) == shape
    mesh = er.v5e_mesh(target)
    assert mesh.size == chips
    assert {d.device_kind for d in mesh.devices.flat} == {kind}
    hw, known = er.internal.hardware(target)
    assert known and hw.kind == kind
    assert [dict(m.shape)["fsdp"] for m in er.internal.mesh_splits(target)][0] == (
        chips // er.internal.slice_count(target)
    )
    x = S((chips * 4, 256), f32, sharding=NamedSharding(mesh, P("data")))
    report = er.memory_report(lambda x: jnp.sin(x).sum(), x, target=target)
    assert report.target == (target if ":" in target else "v5p:2x2x1")
    assert report.argument_bytes == 4 * 256 * 4  # one chip's rows


@needs_libtpu
def test_v5e_dots_uses_less_per_chip_temp_memory_than_none():
    blocks = stacked_blocks(depth=2, d=128, heads=2, dtype=bf16)
    x = S((8, 128, 128), bf16, sharding=NamedSharding(er.v5e_mesh(), P("data")))
    reports = {
        c: er.memory_report(
            train_grad(c), blocks, x, target="v5e", compiler_options=NO_VMEM
        )
        for c in [None, "dots", "nothing"]
    }
    none, dots, nothing = reports[None], reports["dots"], reports["nothing"]
    assert none.temp_bytes > dots.temp_bytes > nothing.temp_bytes > 0
    assert none.flops < dots.flops < nothing.flops
    assert all(r.host_temp_bytes == 0 for r in reports.values())


@needs_libtpu
@pytest.mark.parametrize(
    "saving, offloading",
    [
        (
            er.save_names("qkv_proj", "mlp_hidden"),
            er.offload_names("qkv_proj", "mlp_hidden"),
        ),
        ("dots_no_batch", "offload_dots_no_batch"),
    ],
    ids=["offload_names", "offload_dots_no_batch"],
)
def test_v5e_offload_moves_residuals_to_host(saving, offloading):
    """Offloading is real on the v5e target: host temp memory appears. Whether
    the device then keeps less than when it saves the same values is libtpu's
    decision, and it changed: with libtpu 0.0.42 (jax 0.10.2's) it does; with
    0.0.52 the offloading program keeps more device memory than the saving one
    (2981888 against 2605056 temp bytes, issue 57), and memory_report says so
    in an OffloadWarning that names the policy and both figures. Either way
    the warning is said exactly where the offload does not pay."""
    blocks = stacked_blocks(depth=2, d=128, heads=2, dtype=bf16)
    x = S((8, 128, 128), bf16, sharding=NamedSharding(er.v5e_mesh(), P("data")))

    def report(c, **kwargs):
        return lambda: er.memory_report(
            train_grad(c), blocks, x, target="v5e", **kwargs
        )

    (save, quiet), (off, said) = _said(
        report(saving, compiler_options=NO_VMEM),
        report(offloading, compiler_options=NO_VMEM),
    )
    assert save.host_temp_bytes == 0 and quiet == []
    assert off.host_temp_bytes > 0
    assert rel(off.flops, save.flops) < 0.01
    pays = off.temp_bytes < save.temp_bytes
    expected = OFFLOAD_PAYS_ON_V5E.get(_libtpu_version())
    if expected is not None:
        assert pays == expected, _libtpu_version()
    if pays:
        assert said == []
    else:
        assert len(said) == 1 and "does not pay on v5e:2x2" in said[0]
        assert repr(er.policy(offloading)) in said[0]
        assert f"keeps {er.format_bytes(off.temp_bytes)} of device memory" in said[0]
        assert f"against {er.format_bytes(save.temp_bytes)} when saving" in said[0]
    # Without the flag (the default compile), the host copies are still there,
    # and the warning is said where the rule says so on the default compile's
    # figures.
    (default_save, _), (default, said) = _said(report(saving), report(offloading))
    assert default.host_temp_bytes == off.host_temp_bytes
    from eqx_remat.internal import offload_fails

    assert len(said) == (offload_fails(default, default_save) is not None)


# Whether an offload keeps fewer v5e temp bytes than saving, in the program of
# `test_v5e_offload_moves_residuals_to_host`, by libtpu version (as measured
# for issue 57). Another libtpu is held to the warning's rule only.
OFFLOAD_PAYS_ON_V5E = {"0.0.42.1": True, "0.0.52": False}


def _libtpu_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("libtpu")


@needs_libtpu
@pytest.mark.slow
def test_v5e_dots_saves_memory_in_the_default_compile():
    """On shapes too large for VMEM, the default compile (no flags) shows the
    saving too."""
    blocks = stacked_blocks(depth=8, d=512, heads=8, dtype=bf16)
    x = S((16, 1024, 512), bf16, sharding=NamedSharding(er.v5e_mesh(), P("data")))
    none = er.memory_report(train_grad(None), blocks, x, target="v5e")
    dots = er.memory_report(train_grad("dots"), blocks, x, target="v5e")
    assert dots.temp_bytes < 0.6 * none.temp_bytes


@pytest.mark.heavy
@needs_libtpu
def test_v5e_flash_attention_with_unsharded_arguments():
    """`attention="flash"` needs a TPU: on a v5e target the function is traced on
    the target's mesh, so arguments given as plain `ShapeDtypeStruct`s (no
    sharding) compile, replicated on every chip, and the flash kernels run and
    are counted (their cost estimates, as in interpret mode on the CPU)."""
    import jax.experimental.pallas.tpu as pltpu

    import zoo

    model = zoo.Transformer(32, 128, 32, 2, 1, attention="flash", key=jax.random.key(0))
    model = jax.tree.map(lambda x: S(x.shape, x.dtype) if eqx.is_array(x) else x, model)
    tokens = S((2, 128), jnp.int32)
    grad = eqx.filter_grad(lambda m, t: jnp.mean(jax.vmap(m)(t)))
    one = er.memory_report(grad, model, tokens, target="v5e:1x1")
    with pytest.warns(er.ReplicatedArgumentsWarning):
        four = er.memory_report(grad, model, tokens, target="v5e:2x2")
    assert (one.target, four.target) == ("v5e:1x1", "v5e:2x2")
    # Replicated: each of the 4 chips holds all of the arguments, as one chip does.
    assert four.argument_bytes == one.argument_bytes
    arrays = jax.tree.leaves(eqx.filter((model, tokens), eqx.is_array))
    assert one.argument_bytes >= sum(math.prod(x.shape) * 4 for x in arrays)
    with pltpu.force_tpu_interpret_mode(True):
        interpreted = er.count_flops(grad, model, tokens)
    assert not interpreted.unknown and not one.flops.unknown
    assert one.flops == interpreted > 0


@needs_libtpu
def test_v5e_program_too_large_for_a_chip_raises_xlas_error():
    x = S((2**16, 2**16), bf16)  # 8 GiB per chip, replicated; 16 GiB of temps

    def fn(x):
        return jnp.sin(x) @ jnp.cos(x)

    with (
        pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED") as e,
        pytest.warns(er.ReplicatedArgumentsWarning),
    ):
        er.memory_report(fn, x, target="v5e")
    assert any("does not fit" in note for note in e.value.__notes__)


# --- residuals: the same arguments as count_flops/memory_report, inside scans --


def test_residuals_take_shape_dtype_structs_modules_and_scalars():
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))

    def f(m, x, scale):
        return jnp.sum(jnp.sin(m(x) * scale))

    concrete = er.residuals(f, mlp, jnp.ones(3), 2.0)
    abstract = er.residuals(f, mlp, S((3,), f32), 2.0)
    assert [(r.shape, r.dtype, r.nbytes) for r in concrete] == [
        (r.shape, r.dtype, r.nbytes) for r in abstract
    ]
    assert sum(r.nbytes for r in concrete) > 0


@pytest.mark.heavy
def test_residuals_look_inside_scans(capsys):
    import zoo

    model = zoo.Transformer(
        16, 8, 8, 2, 2, checkpoint=er.save_names("qkv_proj"), key=jax.random.key(0)
    )
    loss = lambda m, t: m(t).sum()
    res = er.residuals(loss, model, S((6,), jnp.int32))
    tagged = [r for r in res if r.name is not None]
    # The scanned blocks save their qkv projection, 6 x 24 per layer, and it is
    # reported by its tag, per layer, with the number of layers.
    assert [(r.name, r.shape, r.layer_shape, r.layers) for r in tagged] == [
        ("qkv_proj", (2, 6, 24), (6, 24), 2)
    ]
    assert tagged[0].nbytes == 2 * 6 * 24 * 4
    assert "inside a scan over 2 layers" in tagged[0].source
    carries = [r for r in res if r.source.startswith("the carry")]
    assert [(r.layer_shape, r.layers) for r in carries] == [((6, 8), 2)]
    er.print_residuals(loss, model, S((6,), jnp.int32))
    lines = capsys.readouterr().out.splitlines()
    assert any(
        line.startswith("float32[6,24] × 2 layers  1.1 KiB  named 'qkv_proj'")
        for line in lines
    ), lines


class _TaggedLayer(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        x = checkpoint_name(x, "block_input")
        return x + jnp.tanh(x @ self.w)


class _Blocks(eqx.Module):
    inner: _TaggedLayer
    checkpoint: Any = eqx.field(static=True)

    def __call__(self, x):
        return er.scan_layers(self.inner, x, checkpoint=self.checkpoint)


@pytest.mark.parametrize("outer", [None, er.save_names("block_input")], ids=str)
def test_residuals_of_nested_scans_under_a_name_policy(outer):
    # 3 blocks of 4 layers, the inner scans under a name policy (and the outer
    # one too): the saved inputs keep their tag and count 3 x 4 layers, through
    # the calls a policy wraps each layer in.
    policy = er.save_names("block_input")
    blocks = _Blocks(_TaggedLayer(jnp.ones((3, 4, 2, 2))), policy)
    loss = lambda b, x: jnp.sum(er.scan_layers(b, x, checkpoint=outer))
    res = er.residuals(loss, blocks, jnp.ones((5, 2)))
    tagged = [(r.name, r.layers, r.layer_shape) for r in res if r.name]
    assert tagged == [("block_input", 12, (5, 2))], res
    assert all(r.layers in (1, 12) for r in res), res


def test_residuals_nested_scans_multiply_layers():
    def f(x):
        def inner(c, _):
            return jnp.sin(c), None

        def outer(c, _):
            return jax.lax.scan(inner, c, None, length=3)[0], None

        return jax.lax.scan(outer, x, None, length=2)[0].sum()

    res = er.residuals(f, jnp.ones(4))
    stacked = [r for r in res if r.layers > 1]
    assert stacked and all(r.layers == 6 for r in stacked)
    assert all(r.layer_shape == (4,) for r in stacked)
    assert all(r.source.count("inside a scan") == 2 for r in stacked)


@needs_libtpu
@pytest.mark.parametrize("schedule", [er.every(16), er.recursive()], ids=str)
def test_count_flops_under_a_v5e_mesh_equals_without(schedule):
    """Values that decide a schedule's branches are computed on this machine's
    CPU, whatever mesh is in context: under a mesh of TPU v5e chips (compiled
    for, never run) the count is the same as without one."""
    layers = er.stack(
        lambda k: _Tanh(eqx.nn.Linear(8, 8, key=k)),
        jax.random.split(jax.random.key(0), 24),
    )
    x = jnp.ones((8,))
    loss = lambda ls, x: er.scan_layers(ls, x, checkpoint=schedule).sum()
    grad = eqx.filter_grad(loss)
    expected = er.count_flops(grad, layers, x)
    with jax.set_mesh(er.v5e_mesh("v5e:2x4")):
        assert er.count_flops(grad, layers, x) == expected


def test_count_flops_without_a_cpu_backend_equals_with(monkeypatch):
    """`JAX_PLATFORMS=cuda` initialises no CPU backend (`jax.devices("cpu")`
    raises): a value that decides a branch is then computed on the default
    backend's device, and the count is the same."""
    from eqx_remat._inspect import _flops

    def f(x):  # `rem` has no NumPy shortcut: JAX computes the branch index
        return lax.cond(lax.rem(jnp.int32(7), 3) == 1, lambda x: x @ x, jnp.sin, x)

    x = jnp.ones((4, 4))
    _flops._cpu_mesh.cache_clear()
    expected = er.count_flops(f, x)
    assert int(expected) >= 2 * 4**3  # the matmul's branch, not sin's
    devices = jax.devices

    def no_cpu(backend=None):
        if backend == "cpu":
            raise RuntimeError("Unknown backend: 'cpu' requested")
        return devices(backend)

    _flops._cpu_mesh.cache_clear()
    monkeypatch.setattr(jax, "devices", no_cpu)
    try:
        assert er.count_flops(f, x) == expected
        assert _flops._cpu_mesh().devices.item() == jax.local_devices()[0]
    finally:
        _flops._cpu_mesh.cache_clear()


def test_scan_sizes_reads_consts_and_carries_in_every_jax():
    """A `scan` equation's constants and carries, whether jax gives their
    counts as parameters (< 0.11) or packs them into `ft_in` (0.11)."""
    from eqx_remat._inspect._jaxpr import scan_sizes

    w = jnp.ones((3, 3))

    def f(c1, c2, xs):
        def body(carry, x):
            a, b = carry
            return (a @ w + x, b + 1), a.sum()

        return lax.scan(body, (c1, c2), xs)

    jaxpr = jax.make_jaxpr(f)(jnp.ones(3), jnp.int32(0), jnp.ones((5, 3)))
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    consts, carry = scan_sizes(eqn)
    assert (consts, carry) == (1, 2)  # w; (a, b)
    assert len(eqn.invars) == consts + carry + 1  # and xs
    assert len(eqn.outvars) == carry + 1  # the carries, then the ys
