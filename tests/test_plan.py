import collections
import importlib.util
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_remat as er
from eqx_remat import _plan
from eqx_remat._binomial import optimal_evaluations


class Layer(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w)


class Stack(eqx.Module):
    layers: Layer
    checkpoint: Any = eqx.field(static=True)

    def __call__(self, x):
        return er.scan_layers(self.layers, x, checkpoint=self.checkpoint)


DEPTH, WIDTH, BATCH = 16, 8, 64
MODEL = Stack(
    er.stack(
        lambda k: Layer(jax.random.normal(k, (WIDTH, WIDTH)) / 4),
        jax.random.split(jax.random.key(0), DEPTH),
    ),
    None,
)
X = jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)
GRAD = eqx.filter_grad(lambda model, x: jnp.sum(model(x) ** 2))
CANDIDATES = (None, "nothing", er.every(4), er.recursive(), er.binomial(2))


def _plan_for(budget, candidates=CANDIDATES):
    # The same function object every time: compilations are cached across calls.
    return er.plan(GRAD, MODEL, X, budget_bytes=budget, candidates=candidates)


@pytest.fixture(scope="module")
def table():
    return _plan_for("1TiB").table


def test_everything_fits_picks_fewest_flops(table):
    result = _plan_for("1TiB")
    assert [e.checkpoint for e in result.table] == list(CANDIDATES)
    assert all(e.fits for e in result.table)
    assert result.entry.flops == min(e.flops for e in table)
    assert result.checkpoint is None  # no recomputation
    assert result.budget_bytes == 2**40 and result.target == "cpu"
    assert "checkpoint" in str(result) and "binomial" in str(result)


def test_budget_between_candidates(table):
    memories = sorted({e.memory_bytes for e in table})
    assert len(memories) >= 4, memories
    for lo, hi in zip(memories, memories[1:]):
        budget = (lo + hi) // 2
        fitting = [e for e in table if e.memory_bytes <= budget]
        expected = min(fitting, key=lambda e: (e.flops, e.memory_bytes))
        result = _plan_for(budget)
        assert result.checkpoint == expected.checkpoint, (budget, str(result))
        assert [e.fits for e in result.table] == [e in fitting for e in table]
        # Whatever is cheaper in FLOPs did not fit.
        cheaper = [e for e in table if e.flops < result.entry.flops]
        assert all(e.memory_bytes > budget for e in cheaper)
    # The budget just below the cheapest candidate's memory excludes it.
    cheapest = min(table, key=lambda e: e.flops)
    result = _plan_for(cheapest.memory_bytes - 1)
    assert result.checkpoint != cheapest.checkpoint
    assert result.entry.memory_bytes <= cheapest.memory_bytes - 1


def test_error_names_the_smallest_memory(table):
    smallest = min(table, key=lambda e: e.memory_bytes)
    with pytest.raises(ValueError, match="No candidate fits") as info:
        _plan_for(smallest.memory_bytes - 1)
    message = str(info.value)
    assert "smallest achievable memory is" in message
    assert f"({smallest.memory_bytes} bytes)" in message
    assert f"checkpoint={smallest.checkpoint}" in message
    # Exactly the smallest memory fits.
    assert _plan_for(smallest.memory_bytes).checkpoint == smallest.checkpoint


def test_table_is_what_the_instruments_say(table):
    by = {str(e.checkpoint): e for e in table}
    args = er.set_checkpoint((MODEL, X), "nothing")
    report = er.memory_report(GRAD, *args)
    entry = by["nothing"]
    assert entry.memory_bytes == (
        report.temp_bytes + report.argument_bytes + report.output_bytes
    )
    assert entry.flops == er.count_flops(GRAD, *args)
    # One FLOP number for every candidate, binomial included: count_flops's,
    # which counts the layer evaluations binomial runs.
    entry = by[str(er.binomial(2))]
    assert entry.flops == er.count_flops(
        GRAD, *er.set_checkpoint((MODEL, X), er.binomial(2))
    )
    # Relative to binomial(DEPTH) (every carry stored, no re-runs), it costs its
    # extra layer evaluations (and a little bookkeeping per stored carry).
    base = _plan_for("1TiB", [er.binomial(DEPTH)]).entry.flops
    one_layer = er.count_flops(lambda w, x: x + jnp.tanh(x @ w), MODEL.layers.w[0], X)
    extra = optimal_evaluations(DEPTH, 2) - optimal_evaluations(DEPTH, DEPTH)
    assert abs((entry.flops - base) - extra * one_layer) <= 0.02 * extra * one_layer


def test_compilations_are_cached(table, monkeypatch):
    calls = []
    real = _plan.memory_report
    monkeypatch.setattr(
        _plan, "memory_report", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    _plan_for("1GiB")
    _plan_for(12345678, CANDIDATES[:2])
    assert calls == []
    # A new function object is a new function.
    er.plan(
        eqx.filter_grad(lambda m, x: jnp.sum(m(x))),
        MODEL,
        X,
        budget_bytes="1GiB",
        candidates=["nothing"],
    )
    assert calls == [1]


def test_apply_sets_the_chosen_checkpoint(table):
    result = _plan_for(min(e.memory_bytes for e in table))
    assert result.apply(MODEL).checkpoint == result.checkpoint
    assert result.apply([MODEL, MODEL])[1].checkpoint == result.checkpoint


# --- budgets -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("16GiB", 16 * 2**30),
        ("512MiB", 512 * 2**20),
        ("512 mib", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("2KB", 2000),
        ("4096", 4096),
        ("4096B", 4096),
        (" 1TiB ", 2**40),
        (".5KiB", 512),
        (1234, 1234),
        (0, 0),
    ],
)
def test_budget_parsing(text, expected):
    assert _plan.parse_bytes(text) == expected
    assert _plan.parse_bytes(np.int64(4096)) == 4096


@pytest.mark.parametrize(
    "bad", ["", "GiB", "16 parsecs", "-1GiB", "1e9", "16GiBs", "1.2.3MB", -1, True]
)
def test_bad_budgets(bad):
    with pytest.raises(ValueError, match="budget_bytes"):
        _plan_for(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"invalid candidates\[1\].*Unknown policy"):
        _plan_for("1GiB", [None, "dot"])
    with pytest.raises(ValueError, match="at least one candidate"):
        _plan_for("1GiB", [])
    with pytest.raises(ValueError, match="`checkpoint` field"):
        er.plan(jax.grad(lambda x: jnp.sum(x**2)), X, budget_bytes="1GiB")


def test_default_candidates_are_valid_and_distinct():
    cands = er.DEFAULT_CANDIDATES
    assert len(set(cands)) == len(cands) >= 12
    assert any(isinstance(c, er.binomial) for c in cands)
    assert None in cands and "nothing" in cands


@pytest.mark.slow
def test_default_grid():
    result = er.plan(
        GRAD, MODEL, X, budget_bytes="1GiB", candidates=er.DEFAULT_CANDIDATES
    )
    assert [e.checkpoint for e in result.table] == list(er.DEFAULT_CANDIDATES)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="needs libtpu (tpu extra)"
)
def test_v5e_target():
    with pytest.warns(
        er.ReplicatedArgumentsWarning, match="no argument has a sharding"
    ):
        result = er.plan(
            GRAD,
            MODEL,
            X,
            budget_bytes="16GiB",
            target="v5e",
            candidates=CANDIDATES[:2],
        )
    assert re.fullmatch(r"v5e:2x2", result.target)
    assert all(e.report.target == "v5e:2x2" for e in result.table)


def test_a_candidate_xla_refuses_is_recorded_and_planning_goes_on(monkeypatch):
    # On TPU v5e, XLA refuses to compile a program larger than one chip's HBM
    # (RESOURCE_EXHAUSTED). Forced here for one candidate, on the CPU.
    real = _plan.memory_report
    message = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
        "for HLO temporaries (16.00G) exceeds available HBM (15.75G)."
    )

    def report(fn, *args, **kwargs):
        if args[0].checkpoint is None:
            raise jax.errors.JaxRuntimeError(message)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(_plan, "memory_report", report)
    grad = eqx.filter_grad(lambda model, x: jnp.sum(model(x) ** 2))  # uncached
    result = er.plan(grad, MODEL, X, budget_bytes="1TiB", candidates=CANDIDATES)
    assert [e.checkpoint for e in result.table] == list(CANDIDATES)
    refused = result.table[0]
    assert refused.report is None and not refused.fits
    assert refused.memory_bytes == 16 * 2**30
    assert "RESOURCE_EXHAUSTED" in refused.error
    assert refused.flops == er.count_flops(grad, MODEL, X)
    assert all(e.fits and e.error is None for e in result.table[1:])
    assert result.checkpoint is not None
    assert ">= 16.00 GiB (XLA)" in str(result)
    # A budget over what XLA says one device holds is planned for the device.
    assert result.budget_bytes == int(15.75 * 2**30)
    assert any("XLA says 15.75 GiB" in n for n in result.notes), result.notes
    # Every candidate refused: a ValueError that says so, with the table.
    with pytest.raises(ValueError, match="XLA refused to compile every one"):
        er.plan(grad, MODEL, X, budget_bytes="1TiB", candidates=[None])


@pytest.mark.parametrize(
    "message, needed",
    [
        ("required for HLO temporaries (18.02G) exceeds available", 18.02 * 2**30),
        ("Used 17.5G of 15.75G hbm", 17.5 * 2**30),
        ("RESOURCE_EXHAUSTED: out of memory", None),
    ],
)
def test_xla_figure_of_what_was_needed(message, needed):
    got = _plan.needed_bytes(message)
    assert got == (None if needed is None else int(needed))


class _Wide(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return x + jnp.tanh(x * self.w[None, :])


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="needs libtpu (tpu extra)"
)
def test_v5e_none_and_every_policy_with_one_too_large_for_a_chip():
    # 16 layers of 1 GiB activations: None keeps ~2 per layer (> 16 GiB of HBM),
    # recursive() a handful.
    model = Stack(
        er.stack(
            lambda k: _Wide(jnp.ones(2**14)), jax.random.split(jax.random.key(0), 16)
        ),
        None,
    )
    x = jax.ShapeDtypeStruct((2**14, 2**14), jnp.float32)
    grad = eqx.filter_grad(lambda m, x: jnp.sum(m(x)))
    candidates = (None, *sorted(er.POLICIES), er.recursive())
    with pytest.warns(er.ReplicatedArgumentsWarning, match="replicated on each"):
        result = er.plan(
            grad, model, x, budget_bytes="15GiB", target="v5e", candidates=candidates
        )
    assert [e.checkpoint for e in result.table] == list(candidates)
    none = result.table[0]
    assert none.report is None and not none.fits and none.memory_bytes > 15 * 2**30
    assert result.table[-1].fits


# --- the solver -----------------------------------------------------------------

from eqx_remat import _solve  # noqa: E402


needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="needs libtpu (tpu extra)"
)


def _option(name, nbytes, time, host=0.0):
    return _solve.Option(name, float(nbytes), float(host), 0.0, float(time), 0)


def _exhaustive(options, base, depth, budget):
    """The least cost over every mix of two options (n layers of one, the rest
    of the other; uniform options included; never one layer of `None`), by
    brute force."""
    best = None
    for a in options:
        for b in options:
            for n in range(depth + 1):
                ones = (n == 1 and a.checkpoint is None) or (
                    depth - n == 1 and b.checkpoint is None
                )
                if ones and 0 < n < depth and a is not b:
                    continue
                if base + n * a.bytes + (depth - n) * b.bytes <= budget:
                    cost = n * a.time + (depth - n) * b.time
                    best = cost if best is None else min(best, cost)
    return best


def _check_against_exhaustive(options, base, depth, budgets):
    for budget in budgets:
        predict = _solve.linear(lambda o: base, depth)
        got = _solve.best_mix(options, predict, depth, budget)
        want = _exhaustive(options, base, depth, budget)
        if want is None:
            assert got is None, budget
            continue
        assert got is not None, budget
        memory = base + got.n * got.heavy.bytes + (depth - got.n) * got.light.bytes
        assert memory <= budget and got.predicted == pytest.approx(memory)
        assert got.cost == pytest.approx(want, rel=1e-12, abs=1e-12), (budget, got)


@pytest.mark.parametrize("seed", range(12))
def test_solver_matches_an_exhaustive_search_on_random_options(seed):
    rng = np.random.default_rng(seed)
    options = [
        _option(i, *rng.uniform(0, 100, 2)) for i in range(int(rng.integers(1, 9)))
    ]
    depth, base = int(rng.integers(1, 13)), float(rng.uniform(0, 50))
    light = base + depth * min(o.bytes for o in options)
    heavy = base + depth * max(o.bytes for o in options)
    _check_against_exhaustive(options, base, depth, np.linspace(light - 1, heavy, 40))


def test_rounding_to_whole_layers_can_beat_hull_neighbours():
    # A, B, C are all on the lower hull; at a budget of 3 bytes over 2 layers the
    # neighbours A-B or B-C give 12 (B on both layers), but A + C gives 10.
    a, b, c = _option("A", 0, 10), _option("B", 1, 6), _option("C", 3, 0)
    assert _solve.lower_hull([a, b, c]) == [a, b, c]
    got = _solve.best_mix([a, b, c], _solve.linear(lambda o: 0.0, 2), 2, 3)
    assert (got.light, got.heavy, got.n, got.cost) == (a, c, 1, 10)


def test_a_mix_never_has_one_layer_without_checkpoint():
    # One layer of None would be the cheapest fit (A on 3 layers, None on 1),
    # but a one-layer range of None is no loop, and its memory is not its price.
    a, none = _option("A", 0, 10), _option(None, 2, 0)
    got = _solve.best_mix([a, none], _solve.linear(lambda o: 0.0, 4), 4, 2)
    assert (got.light, got.n, got.cost) == (a, 0, 40)
    got = _solve.best_mix([a, none], _solve.linear(lambda o: 0.0, 4), 4, 4)
    assert (got.light, got.heavy, got.n, got.cost) == (a, none, 2, 20)


def test_lower_hull_drops_dominated_and_non_convex_options():
    a, b, c = _option("A", 0, 10), _option("B", 2, 9), _option("C", 3, 0)
    worse = _option("D", 4, 1)  # heavier and slower than C
    assert _solve.lower_hull([worse, c, b, a]) == [a, c]  # B is above the A-C line
    assert _solve.pareto([worse, c, b, a]) == [a, b, c]


# A tiny transformer, for the planner on a real model (CPU, a few compiles).
import zoo  # noqa: E402


TINY_DEPTH = 4
TINY = zoo.Transformer(32, 16, 16, 2, TINY_DEPTH, key=jax.random.key(0))
TOKENS = jax.ShapeDtypeStruct((4, 16), jnp.int32)
TINY_GRAD = eqx.filter_grad(lambda m, t: jnp.mean(jax.vmap(m)(t)))
UNIFORM = (None, "dots", "dots_no_batch", "nothing")


def _tiny_planner(target=None, args=(TINY, TOKENS), budget=2**40):
    return _plan._Planner(TINY_GRAD, args, budget, target, _plan._Progress(False))


@pytest.fixture(scope="module")
def tiny_options():
    planner = _tiny_planner()
    planner.depths, planner.per = frozenset({TINY_DEPTH}), TINY_DEPTH
    return planner._price_options()


def test_solver_on_priced_options_matches_an_exhaustive_search(tiny_options):
    # The options of a real model, priced by tracing (no compile): saving more
    # costs bytes and saves recomputation.
    by = {o.checkpoint: o for o in tiny_options}
    assert by[None].flops == 0 and by[None].bytes > by["dots"].bytes
    assert by["nothing"].bytes < by["dots"].bytes and by["nothing"].flops > 0
    names = {
        t
        for o in tiny_options
        if isinstance(o.checkpoint, er.save_names)
        for t in o.checkpoint.names
    }
    assert names == {
        "layer_input",
        "qkv_proj",
        "attention_context",
        "out_proj",
        "mlp_hidden",
        "mlp_out",
    }
    base = 1e6
    light = base + TINY_DEPTH * min(o.bytes for o in tiny_options)
    heavy = base + TINY_DEPTH * by[None].bytes
    _check_against_exhaustive(
        tiny_options, base, TINY_DEPTH, np.linspace(light, heavy, 60)
    )


@pytest.fixture(scope="module")
def tiny_table():
    """Every uniform policy, compiled (once: the planner reuses these)."""
    result = er.plan(
        TINY_GRAD, TINY, TOKENS, budget_bytes="1TiB", candidates=UNIFORM, progress=False
    )
    return result.table


def _tiny_budgets(table):
    memories = sorted(e.memory_bytes for e in table)
    mids = [(lo + hi) // 2 for lo, hi in zip(memories, memories[1:])]
    return [memories[0], *mids, memories[-1]]


def test_the_pick_fits_and_costs_no_more_than_the_best_uniform_candidate(tiny_table):
    for budget in _tiny_budgets(tiny_table):
        result = er.plan(TINY_GRAD, TINY, TOKENS, budget_bytes=budget, progress=False)
        entry = result.entry
        assert entry.fits and entry.memory_bytes <= budget, str(result)
        assert entry.report is not None and result.table == ()
        fitting = [e for e in tiny_table if e.memory_bytes <= budget]
        assert entry.time_s <= min(e.time_s for e in fitting) * (1 + 1e-9), str(result)
        # The pick is on the frontier, compiled, and predicted within 5%.
        (point,) = [p for p in result.frontier if p.checkpoint == result.checkpoint]
        assert point.compiled_bytes == entry.memory_bytes
        assert abs(point.predicted_bytes - point.compiled_bytes) <= 0.05 * (
            point.compiled_bytes
        ), str(result)
        # The frontier: less memory costs more time, and it is printed.
        memories = [p.compiled_bytes or p.predicted_bytes for p in result.frontier]
        times = [p.time_s for p in result.frontier]
        assert memories == sorted(memories) and times == sorted(times, reverse=True)
        assert "frontier:" in str(result) and "est. time" in str(result)


def test_the_cheapest_option_that_fits_needs_no_more_than_the_two_ends():
    # The planner compiles the two ends of the hull (the cheapest and the
    # lightest option: their base memory) and nothing else when the cheapest
    # fits. Fewer when an earlier call of this process compiled them already.
    result = er.plan(TINY_GRAD, TINY, TOKENS, budget_bytes="1TiB", progress=False)
    assert result.checkpoint is None and result.compiles <= 2
    assert result.entry.time_s == min(p.time_s for p in result.frontier)


def test_a_mispriced_pick_loses_to_a_compiled_uniform_option(tiny_table, monkeypatch):
    # Price 'nothing' at half None's FLOPs (it recomputes the forward: it costs
    # more): the solver picks it, its compile counts its FLOPs exactly, and the
    # planner returns what really costs least among what fits.
    true_price = _plan.price

    def wrong_price(fn, args, checkpoint, depths):
        device, host, flops, names = true_price(fn, args, checkpoint, depths)
        if checkpoint == "nothing":
            flops = true_price(fn, args, None, depths)[2] // 2
        return device, host, flops, names

    monkeypatch.setattr(_plan, "price", wrong_price)
    monkeypatch.setattr(_plan, "_PRICES", type(_plan._PRICES)())  # price afresh
    result = er.plan(TINY_GRAD, TINY, TOKENS, budget_bytes="1TiB", progress=False)
    by = {e.checkpoint: e for e in tiny_table}
    assert by["nothing"].time_s > by[None].time_s
    assert result.entry.fits and result.entry.report is not None
    assert result.entry.time_s <= by[None].time_s * (1 + 1e-9), str(result)
    assert result.checkpoint is None, str(result)
    assert any("'nothing' compiled to" in n for n in result.notes), result.notes
    (point,) = [p for p in result.frontier if p.checkpoint == result.checkpoint]
    assert point.flops == by[None].flops and point.time_s == result.entry.time_s


def test_nothing_fits_names_the_smallest_memory(tiny_table):
    # Below the arguments and outputs, which every checkpoint needs: no schedule
    # is worth compiling either.
    report = tiny_table[0].report
    budget = report.argument_bytes + report.output_bytes - 1
    with pytest.raises(ValueError, match="smallest achievable memory is") as info:
        er.plan(TINY_GRAD, TINY, TOKENS, budget_bytes=budget, progress=False)
    smallest = min(e.memory_bytes for e in tiny_table)
    assert f"({smallest} bytes)" in str(info.value)


def test_progress_on_stderr_only_when_asked(capsys, tiny_table):
    er.plan(TINY_GRAD, TINY, TOKENS, budget_bytes="1TiB")
    err = capsys.readouterr().err
    for line in (
        "plan: tracing",
        "1 stack(s) of 4 layers",
        "priced 'dots'",
        "lower convex hull",
        "plan: done",
    ):
        assert line in err, err
    assert re.search(r"compiles?, \d+\.\d s", err), err
    er.plan(TINY_GRAD, TINY, TOKENS, budget_bytes="1TiB", progress=False)
    er.plan(GRAD, MODEL, X, budget_bytes="1TiB", candidates=[None], progress=False)
    assert capsys.readouterr().err == ""
    er.plan(GRAD, MODEL, X, budget_bytes="1TiB", candidates=[None])
    assert "plan: compiling 1 candidates" in capsys.readouterr().err


def test_offloading_is_priced_with_the_host_link():
    # Offloading a tag keeps it on the host instead of the device: fewer device
    # bytes than saving it, as many FLOPs, and 2 × bytes over the host link.
    depths = frozenset({TINY_DEPTH})
    save = _solve.price(TINY_GRAD, (TINY, TOKENS), er.save_names("mlp_hidden"), depths)
    off = _solve.price(
        TINY_GRAD, (TINY, TOKENS), er.offload_names("mlp_hidden"), depths
    )
    nothing = _solve.price(TINY_GRAD, (TINY, TOKENS), "nothing", depths)
    assert off[1] == save[0] - nothing[0] > 0  # host bytes: the tag's
    assert off[0] == nothing[0]
    assert abs(off[2] - save[2]) <= 0.01 * save[2]  # the same recomputation
    v5e = er.internal.HARDWARE["TPU v5 lite"]
    assert v5e.peak_flops == 197e12 and v5e.host_bytes_per_s == 16e9
    t = _solve.option_time(v5e, 1e9, off[1])
    assert t == pytest.approx(1e9 / 197e12 + 2 * off[1] / 16e9)
    assert er.internal.HARDWARE["cpu"].host_bytes_per_s is None


@needs_libtpu
def test_v5e_prices_offloading_and_splits_by_the_batch_sharding():
    from jax.sharding import NamedSharding, PartitionSpec as P

    tokens = jax.ShapeDtypeStruct(
        (4, 16), jnp.int32, sharding=NamedSharding(er.v5e_mesh(), P("data"))
    )
    planner = _tiny_planner("v5e", (TINY, tokens))
    planner.depths, planner.per = frozenset({TINY_DEPTH}), TINY_DEPTH
    assert planner.share == 1 / 4 and planner.host
    by = {o.checkpoint: o for o in planner._price_options()}
    offloading = [o for o in by.values() if o.host_bytes > 0]
    assert "offload_dots_no_batch" in by and offloading
    for o in offloading:
        if isinstance(o.checkpoint, er.offload_names):
            saving = by[er.save_names(*o.checkpoint.names)]
            assert o.time > saving.time  # the host link is not free
            assert o.bytes < saving.bytes


@needs_libtpu
def test_replicated_arguments_on_a_multi_chip_target_are_reported():
    with pytest.warns(er.ReplicatedArgumentsWarning, match="zoo.shard_batch"):
        er.plan(
            GRAD,
            MODEL,
            X,
            budget_bytes="16GiB",
            target="v5e:2x2",
            candidates=[None],
            progress=False,
        )
    with pytest.warns(er.ReplicatedArgumentsWarning, match="v5e_mesh"):
        er.memory_report(GRAD, MODEL, X, target="v5e:2x2")


class _TwoStacks(eqx.Module):
    a: Stack
    b: Stack

    def __call__(self, x):
        return self.b(self.a(x))


def test_stacks_of_different_depths_plan_uniform_options():
    def stack(depth, seed):
        layers = er.stack(
            lambda k: Layer(jax.random.normal(k, (WIDTH, WIDTH)) / 4),
            jax.random.split(jax.random.key(seed), depth),
        )
        return Stack(layers, None)

    model = _TwoStacks(stack(2, 0), stack(3, 1))
    grad = eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2))
    result = er.plan(grad, model, X, budget_bytes="1TiB", progress=False)
    assert any("different depths (2, 3)" in n for n in result.notes)
    assert result.checkpoint is None
    assert result.apply(model).b.checkpoint is None


def test_a_function_that_differentiates_no_stack_is_an_error():
    with pytest.raises(ValueError, match="differentiate the stacks"):
        er.plan(lambda m, x: m(x), MODEL, X, budget_bytes="1TiB", progress=False)


# --- mixes of two options over the layers (needs layer ranges) -------------------


def test_mixes_fit_cost_less_between_uniform_options_and_are_predicted(tiny_table):
    # Halfway between the lightest two uniform options, and between the
    # heaviest two (None and the next).
    mids = _tiny_budgets(tiny_table)[1:-1]
    budgets = [mids[0], mids[-1]]
    cheaper = 0
    for budget in budgets:
        result = er.plan(TINY_GRAD, TINY, TOKENS, budget_bytes=budget, progress=False)
        assert result.entry.fits, str(result)
        fitting = [e for e in tiny_table if e.memory_bytes <= budget]
        best_uniform = min(e.time_s for e in fitting)
        assert result.entry.time_s <= best_uniform * (1 + 1e-9), str(result)
        cheaper += result.entry.time_s < best_uniform * (1 - 1e-6)
        for p in result.frontier:
            if p.compiled_bytes is not None and p.checkpoint == result.checkpoint:
                assert abs(p.predicted_bytes - p.compiled_bytes) <= 0.05 * (
                    p.compiled_bytes
                ), str(result)
    # Between uniform points, a mix beats the tighter uniform option.
    assert cheaper >= 1, budgets


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="a known limit of the planner's memory model: on this 4-layer model a "
    "mix with heavier layers last can compile a little below 'nothing' "
    "alone (seen: 'nothing' 278176 B, the pick at that budget, 8.02e-05 s; a "
    "fitting mix 7.70e-05 s), and the model, which predicts a mix at least at "
    "its light option's memory, does not see it.",
)
def test_the_pick_beats_every_compiled_two_option_mix(monkeypatch):
    """Every mix of two of None, "dots" and "nothing" over the layers that the
    planner proposes (the heavier last, never one layer of None), compiled: at
    each budget the planner's pick costs no more than the cheapest of them that
    fits. Budgets from the lightest uniform option's memory up: below it, the
    planner's model sees no mix that fits and turns to schedules. The planner
    starts from nothing learnt (earlier tests' plans of this model would teach
    it what mixes compiled to)."""
    monkeypatch.setattr(_plan, "_PRICES", collections.OrderedDict())
    options = (None, "dots", "nothing")
    entries = []
    for i, heavy in enumerate(options):
        for light in options[i + 1 :]:
            for n in range(2 if heavy is None else 1, TINY_DEPTH):
                c = er.ranges((TINY_DEPTH - n, light), (n, heavy))
                entries.append(_tiny_planner().measure(c))
    result = er.plan(
        TINY_GRAD, TINY, TOKENS, budget_bytes="1TiB", candidates=options, progress=False
    )
    entries += list(result.table)
    lightest = min(e.memory_bytes for e in result.table)
    memories = sorted(e.memory_bytes for e in entries if e.memory_bytes >= lightest)
    for budget in memories[:: max(1, len(memories) // 6)]:
        pick = er.plan(TINY_GRAD, TINY, TOKENS, budget_bytes=budget, progress=False)
        fitting = [e for e in entries if e.memory_bytes <= budget]
        assert pick.entry.fits
        assert pick.entry.time_s <= min(e.time_s for e in fitting) * (1 + 1e-9)


def _calibrated_planner(tiny_options):
    """A planner of the tiny model with its options priced and every uniform
    policy compiled (once: later calls take them from the cache)."""
    planner = _tiny_planner()
    planner.depths, planner.per = frozenset({TINY_DEPTH}), TINY_DEPTH
    planner.priced = {o.checkpoint: o for o in tiny_options}
    for c in UNIFORM:
        planner.measure(c)
    return planner


@pytest.mark.parametrize(
    "schedule",
    [er.every(2), er.every(2, "dots"), er.nested(2), er.recursive(), er.binomial(2)],
    ids=str,
)
def test_a_schedule_compiles_to_no_less_than_its_floor(tiny_options, schedule):
    # The planner does not compile a schedule whose floor is over the budget:
    # the floor must be at most what the schedule compiles to, and more than
    # the least base memory (it counts the carries the schedule stores).
    planner = _calibrated_planner(tiny_options)
    floor = planner._floor(schedule)
    least = min(planner._base(planner.priced[c]) for c in UNIFORM)
    assert least < floor <= planner.measure(schedule).memory_bytes


def test_an_option_refused_on_every_layer_is_predicted_from_compiled_mixes(
    tiny_options,
):
    # Where XLA refuses an option on every layer, it gives only a lower bound
    # of its memory; a compiled mix with it on its heavy layers tells more, for
    # that mix and for mixes of another light option under it.
    planner = _calibrated_planner(tiny_options)
    none, dots, nothing = (planner.priced[c] for c in (None, "dots", "nothing"))
    entry = planner.compiled[None][0]
    refused = entry._replace(report=None, memory_bytes=entry.memory_bytes // 4)
    planner.compiled[None] = (refused, None)
    assert planner._base(none) == entry.memory_bytes // 4 - TINY_DEPTH * none.bytes
    model = _solve.linear(lambda o: planner._base(o) or 0.0, TINY_DEPTH)
    mix = er.ranges((2, "dots"), (2, None))
    memory = planner.measure(mix).memory_bytes
    error = memory - float(model(dots, none, np.array(2)))
    assert error > 0  # the lower bound under-predicts
    planner.mixes[mix] = memory
    predict = planner._predictor()
    assert float(predict(dots, none, np.array(2))) == pytest.approx(memory)
    n = np.array([2, 3])
    np.testing.assert_allclose(
        predict(nothing, none, n), model(nothing, none, n) + error
    )


def test_compiled_mixes_correct_the_predictions_of_the_next(tiny_options):
    # XLA's memory is not exactly linear in the layers. Where mixes of the same
    # two options were compiled, the model's error there is interpolated over
    # the count (and held beyond); any other pair gets the largest excess.
    planner = _calibrated_planner(tiny_options)
    nothing, dots, none = (planner.priced[c] for c in ("nothing", "dots", None))
    counts = np.arange(1, TINY_DEPTH)
    model = _solve.linear(lambda o: planner._base(o) or 0.0, TINY_DEPTH)
    predict = planner._predictor()  # nothing compiled yet: the model
    for pair in ((nothing, dots), (dots, none), (nothing, none)):
        np.testing.assert_allclose(predict(*pair, counts), model(*pair, counts))
    at = {n: float(model(nothing, dots, np.array(n))) for n in (1, 3)}
    planner.mixes[er.ranges((3, "nothing"), (1, "dots"))] = at[1] + 1000
    planner.mixes[er.ranges((1, "nothing"), (3, "dots"))] = at[3] - 3000  # less
    predict = planner._predictor()
    np.testing.assert_allclose(
        predict(nothing, dots, counts) - model(nothing, dots, counts),
        [1000, -1000, -3000],
    )
    for pair in ((dots, none), (nothing, none)):
        np.testing.assert_allclose(predict(*pair, counts), model(*pair, counts) + 1000)
    for o in (nothing, dots, none):  # uniform options: compiled, exact
        compiled = planner.compiled[o.checkpoint][0].memory_bytes
        np.testing.assert_allclose(predict(o, o, np.zeros(1)), [compiled])
    # The solver takes the correction: where the model fits 3 layers of "dots"
    # over "nothing", a compiled excess of 1000 bytes fits fewer.
    planner.mixes = {er.ranges((1, "nothing"), (3, "dots")): at[3] + 1000}
    predict = planner._predictor()
    budget = at[3] + 500
    plain = _solve.best_mix([nothing, dots], model, TINY_DEPTH, budget)
    tighter = _solve.best_mix([nothing, dots], predict, TINY_DEPTH, budget)
    assert (plain.light, plain.heavy, plain.n) == (nothing, dots, 3)
    assert tighter.n < 3 and tighter.predicted <= budget


def test_after_mixes_that_do_not_fit_the_planner_chooses_among_uniform_options(
    monkeypatch,
):
    # A model of memory that says every mix needs nothing: each mix it picks
    # compiles over the budget. After `_MIX_TRIES` of them the planner stops
    # mixing, says so, and picks the best uniform option that fits.
    real = _plan._Planner._predictor

    def optimistic(self):
        predict = real(self)
        return lambda light, heavy, n: predict(light, heavy, n) * (light == heavy)

    monkeypatch.setattr(_plan._Planner, "_predictor", optimistic)
    monkeypatch.setattr(_plan, "_MIX_TRIES", 1)
    monkeypatch.setattr(_plan, "_PRICES", collections.OrderedDict())
    nothing, dots = (
        _tiny_planner().measure(c).memory_bytes for c in ("nothing", "dots")
    )
    budget = (nothing + dots) // 2
    result = er.plan(TINY_GRAD, TINY, TOKENS, budget_bytes=budget, progress=False)
    assert any("1 mixes did not fit when compiled" in n for n in result.notes)
    assert any("was predicted to fit" in n for n in result.notes)
    assert result.entry.fits and not isinstance(result.checkpoint, er.ranges)
