"""`plan` on a model with several stacks: each stack gets its own checkpoint,
chosen together under one budget; `set_checkpoint` by path. Tests never time
anything: the bench's clock is fake (a step time from FLOPs and memory)."""

import itertools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import check_close

import eqx_remat as er
from eqx_remat._inspect._targets import Target
from eqx_remat._planning.testing import (
    Bench,
    CostModel,
    Evidence,
    Option,
    Part,
    PlanCache,
    Prices,
    Problem,
    Progress,
    Stack,
    best_plan,
    plan_on,
)
from eqx_remat.internal import Hardware, Timing


def _fake_seconds(record) -> float:
    return record.flops * 1e-10 + record.report.temp_bytes * 1e-13


def _fake_clock(programs, *, rounds, warmup=True, **race):
    return [Timing(_fake_seconds(p.record), 0.0, rounds) for p in programs]


_CPU = Hardware("cpu", 1e10, 1e10, None, None, "fixed for the tests")
CACHE = PlanCache()


def _bench(**kwargs) -> Bench:
    kwargs = {"cache": CACHE, "clock": _fake_clock, **kwargs}
    return Bench(
        Target(None, figures=_CPU),
        True,
        say=Progress(False),
        warm=lambda programs: 0.0,
        **kwargs,
    )


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, width, *, key):
        self.norm = eqx.nn.LayerNorm(width)
        self.mlp = eqx.nn.MLP(width, width, 2 * width, depth=1, key=key)

    def __call__(self, x):
        return x + self.mlp(self.norm(x))


class EncoderDecoder(eqx.Module):
    """An encoder and a decoder of other widths and depths: two stacks."""

    encoder: er.Stacked
    project: eqx.nn.Linear
    decoder: er.Stacked

    def __init__(self, *, key):
        ekey, pkey, dkey = jax.random.split(key, 3)
        self.encoder = er.Stacked([Block(8, key=k) for k in jax.random.split(ekey, 4)])
        self.project = eqx.nn.Linear(8, 24, key=pkey)
        self.decoder = er.Stacked([Block(24, key=k) for k in jax.random.split(dkey, 3)])

    def __call__(self, x):
        return self.decoder(self.project(self.encoder(x)))


MODEL = EncoderDecoder(key=jax.random.key(0))
X = jax.random.normal(jax.random.key(1), (32, 8))
GRAD = eqx.filter_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))
PATHS = (".encoder.checkpoint", ".decoder.checkpoint")
UNIFORM = (None, "dots", "nothing")


@pytest.fixture(scope="module")
def pairs():
    """Every pair of uniform options (one per stack), compiled: its memory and
    its time by the tests' clock."""
    bench = _bench()
    problem = Problem.of(GRAD, (MODEL, X), bench.target)
    out = {}
    for a, b in itertools.product(UNIFORM, UNIFORM):
        c = er.PerStack({PATHS[0]: a, PATHS[1]: b})
        record, _ = bench.compile(problem, c)
        out[a, b] = record.memory_bytes, _fake_seconds(record)
    return out


# --- set_checkpoint by path --------------------------------------------------------


def test_set_checkpoint_by_path_sets_each_stack():
    model = er.set_checkpoint(MODEL, {PATHS[0]: "nothing", PATHS[1]: er.every(2)})
    assert model.encoder.checkpoint == "nothing"
    assert model.decoder.checkpoint == er.every(2)
    # The others are kept.
    model = er.set_checkpoint(model, {PATHS[1]: None})
    assert model.encoder.checkpoint == "nothing" and model.decoder.checkpoint is None
    # A PerStack is such a mapping: hashable, compared by value.
    c = er.PerStack({PATHS[0]: "dots", PATHS[1]: None})
    assert c == er.PerStack(dict(c)) and hash(c) == hash(er.PerStack(dict(c)))
    assert c != er.PerStack({PATHS[1]: None, PATHS[0]: "dots"})  # the order
    assert er.set_checkpoint(MODEL, c).encoder.checkpoint == "dots"


def test_a_path_that_names_no_stack_is_an_error_listing_those_there_are():
    with pytest.raises(ValueError, match=r"'\.encoder\.checkpoint'.*Got '\.enc'"):
        er.set_checkpoint(MODEL, {".enc": "nothing"})
    with pytest.raises(ValueError, match=r"spec\['\.encoder\.checkpoint'\].*dot"):
        er.set_checkpoint(MODEL, {PATHS[0]: "dot"})
    with pytest.raises(ValueError, match="PerStack: checkpoint of"):
        er.PerStack({PATHS[0]: "dot"})
    # Paths are text: two keys that are the same text are one path twice.
    with pytest.raises(ValueError, match="one checkpoint per path. Got '1' and 1"):
        er.PerStack({"1": "dots", 1: "nothing"})


# --- a model and its optimiser state --------------------------------------------------


OPT = optax.adamw(1e-2)
with jax.numpy_dtype_promotion("standard"):
    STATE = OPT.init(eqx.filter(MODEL, eqx.is_array))


def _step(model, opt_state, x):
    """A training step as users write it: AdamW's state holds copies of the
    model's modules (`mu`, `nu`), `checkpoint` fields included."""
    grads = GRAD(model, x)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes its int32 count
        params = eqx.filter(model, eqx.is_array)
        updates, opt_state = OPT.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state


@pytest.mark.parametrize(
    "model_first", [True, False], ids=["model-first", "state-first"]
)
def test_set_checkpoint_by_path_sets_the_copies_in_the_optimiser_state(model_first):
    # Paths from inside the model name its fields in (model, opt_state) and
    # in each copy of the model in Adam's `mu` and `nu`: one call switches
    # both, and the next update sees matching structures.
    c = er.PerStack({PATHS[0]: "nothing", PATHS[1]: er.every(2)})
    tree = (MODEL, STATE) if model_first else (STATE, MODEL)
    out = er.set_checkpoint(tree, c)
    model, state = out if model_first else out[::-1]
    for part in (model, state[0].mu, state[0].nu):
        assert part.encoder.checkpoint == "nothing"
        assert part.decoder.checkpoint == er.every(2)
    new_model, new_state = _step(model, state, X)
    assert new_model.decoder.checkpoint == er.every(2)
    # The copies follow full paths too, and the gradients are unchanged.
    full = er.set_checkpoint((MODEL, STATE), {f"[0]{PATHS[0]}": "dots"})
    assert full[1][0].mu.encoder.checkpoint == "dots"
    check_close(
        er.set_checkpoint(GRAD(model, X), None),
        GRAD(er.set_checkpoint(MODEL, None), X),
        rtol=1e-5,
        atol=1e-6,
    )


def test_copies_of_two_models_of_one_type_each_follow_their_own():
    # Two arguments of one type, and one optimiser state over both: each copy
    # follows the model whose arrays it has the shapes of.
    import zoo

    a = zoo.MLP(4, 1, 8, 3, key=jax.random.key(0))
    b = zoo.MLP(4, 1, 8, 2, key=jax.random.key(1))
    with jax.numpy_dtype_promotion("standard"):
        state = OPT.init(eqx.filter((a, b), eqx.is_array))
    c = {"[0].checkpoint": "dots", "[1].checkpoint": "nothing"}
    a, b, state = er.set_checkpoint((a, b, state), c)
    assert (a.checkpoint, b.checkpoint) == ("dots", "nothing")
    for moment in (state[0].mu, state[0].nu):
        assert (moment[0].checkpoint, moment[1].checkpoint) == ("dots", "nothing")


# --- planning ------------------------------------------------------------------------


def _budgets(pairs):
    memories = sorted({m for m, _ in pairs.values()})
    return [memories[0], *((a + b) // 2 for a, b in zip(memories, memories[1:]))]


@pytest.mark.heavy
def test_each_stack_gets_its_own_checkpoint_that_fits_and_beats_every_pair(pairs):
    same_everywhere_beaten = 0
    for budget in _budgets(pairs)[:4]:
        result = plan_on(_bench(), GRAD, MODEL, X, budget_bytes=budget)
        assert isinstance(result.checkpoint, er.PerStack), str(result)
        assert tuple(result.checkpoint) == PATHS
        entry = result.entry
        assert entry.fits and entry.memory_bytes <= budget, str(result)
        fitting = [t for m, t in pairs.values() if m <= budget]
        assert entry.time_s <= min(fitting) * (1 + 1e-9), str(result)
        same = [t for (a, b), (m, t) in pairs.items() if a == b and m <= budget]
        same_everywhere_beaten += bool(same) and entry.time_s < min(same)
        # Applied, each stack gets its own; gradients as without checkpointing.
        model = result.apply(MODEL)
        for path, part in zip(PATHS, (model.encoder, model.decoder)):
            assert part.checkpoint == result.checkpoint[path]
        want = GRAD(er.set_checkpoint(MODEL, None), X)
        got = GRAD(model, X)
        check_close(er.set_checkpoint(got, None), want, rtol=1e-5, atol=1e-6)
        assert "'.encoder.checkpoint'" in str(result)
    assert same_everywhere_beaten >= 1


@pytest.mark.heavy
def test_with_micro_batches_each_stack_still_gets_its_own_checkpoint(pairs):
    # The batch planner solves each way of running the batch as `plan` does:
    # a checkpoint per stack, named by its path in the model, for the pick
    # and for every way it compared.
    budget = _budgets(pairs)[1]
    result = plan_on(
        _bench(), GRAD, MODEL, X, budget_bytes=budget, micro_batches=(1, 2)
    )
    assert isinstance(result.checkpoint, er.PerStack), str(result)
    assert tuple(result.checkpoint) == PATHS
    assert result.entry.fits and result.entry.memory_bytes <= budget, str(result)
    assert {b.micro_batches for b in result.batches} <= {1, 2}
    for b in result.batches:
        assert isinstance(b.checkpoint, er.PerStack) and tuple(b.checkpoint) == PATHS
    model = result.apply(MODEL)
    for path, part in zip(PATHS, (model.encoder, model.decoder)):
        assert part.checkpoint == result.checkpoint[path]
    want = GRAD(er.set_checkpoint(MODEL, None), X)
    got = result.step(GRAD)(model, X)
    check_close(er.set_checkpoint(got, None), want, rtol=1e-5, atol=1e-6)


@pytest.mark.heavy
def test_the_pick_of_several_stacks_races_its_rivals_and_the_swap_is_noted(pairs):
    # As for one stack: two plans 1% apart when timed with the others, the
    # second faster in a race (the clock's longer rounds): the planner races
    # the pick with it, returns it, and says so.
    (fast, t_fast), (second, _) = sorted(
        ((k, t) for k, (_, t) in pairs.items()), key=lambda kt: kt[1]
    )[:2]
    plan = er.PerStack({PATHS[0]: second[0], PATHS[1]: second[1]})

    def clock(programs, *, rounds, warmup=True, **race):
        out = _fake_clock(programs, rounds=rounds)
        slow = 0.8 if rounds == 31 else 1.01  # a race runs up to 31 rounds
        return [
            t._replace(seconds=t_fast * slow) if p.record.checkpoint == plan else t
            for t, p in zip(out, programs)
        ]

    bench = _bench(clock=clock, cache=PlanCache())
    result = plan_on(bench, GRAD, MODEL, X, budget_bytes="1TiB")
    assert tuple(result.checkpoint.values()) == second, str(result)
    assert any("ran 1.250x the step time of" in n for n in result.notes), result.notes


@pytest.mark.heavy
def test_nothing_fits_several_stacks_names_the_smallest_memory(pairs):
    # Below every plan: the error names the least memory compiled, no more
    # than any pair of uniform options needs, and that budget is planned for.
    with pytest.raises(ValueError, match="compiled, the least memory is") as info:
        plan_on(_bench(), GRAD, MODEL, X, budget_bytes=1000)
    (named,) = re.findall(r"\((\d+) bytes\)", str(info.value))
    assert int(named) <= min(m for m, _ in pairs.values())
    result = plan_on(_bench(), GRAD, MODEL, X, budget_bytes=int(named))
    assert result.entry.fits and result.entry.memory_bytes <= int(named)
    assert isinstance(result.checkpoint, er.PerStack)


@pytest.mark.heavy
def test_plan_a_training_step_with_adamw_and_switch_model_and_state_in_one_call():
    # The training step users write: AdamW's `mu` and `nu` hold copies of the
    # model's modules. Planned, the pick fits; `result.apply((model,
    # opt_state))` switches both; the next update works; gradients unchanged.
    bench = _bench()
    problem = Problem.of(_step, (MODEL, STATE, X), bench.target)
    low = bench.compile(problem, "nothing")[0].memory_bytes
    high = bench.compile(problem, None)[0].memory_bytes
    budget = (low + high) // 2
    result = plan_on(bench, _step, MODEL, STATE, X, budget_bytes=budget)
    assert result.stacks == PATHS, str(result)
    assert isinstance(result.checkpoint, er.PerStack), str(result)
    assert tuple(result.checkpoint) == PATHS
    assert result.entry.fits and result.entry.memory_bytes <= budget, str(result)
    model, state = result.apply((MODEL, STATE))
    for part in (model, state[0].mu, state[0].nu):
        assert part.encoder.checkpoint == result.checkpoint[PATHS[0]]
        assert part.decoder.checkpoint == result.checkpoint[PATHS[1]]
    record, _ = bench.compile(problem, result.checkpoint)
    assert record.memory_bytes == result.entry.memory_bytes <= budget
    new_model, new_state = _step(model, state, X)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    check_close(
        er.set_checkpoint(GRAD(model, X), None),
        GRAD(er.set_checkpoint(MODEL, None), X),
        rtol=1e-5,
        atol=1e-6,
    )


def test_plan_a_one_stack_training_step_with_adam():
    # The example: one stack (k = 1), Adam's state among the arguments.
    import zoo

    model = zoo.MLP(4, 1, 8, 3, key=jax.random.key(0))
    opt = optax.adam(1e-3)
    with jax.numpy_dtype_promotion("standard"):
        state = opt.init(eqx.filter(model, eqx.is_array))
    grad = eqx.filter_grad(lambda m, x: jnp.sum(jax.vmap(m)(x)))

    def step(m, s, x):
        with jax.numpy_dtype_promotion("standard"):
            return opt.update(grad(m, x), s, eqx.filter(m, eqx.is_array))

    x = jnp.ones((4, 4))
    result = plan_on(_bench(), step, model, state, x, budget_bytes="1MiB")
    assert result.stacks == (".checkpoint",)
    assert result.entry.fits and result.entry.memory_bytes <= 2**20, str(result)
    model, state = result.apply((model, state))
    assert model.checkpoint == state[0].mu.checkpoint == result.checkpoint
    updates, _ = step(model, state, x)
    check_close(updates, step(*er.set_checkpoint((model, state), None), x)[0])


def test_a_plan_result_names_the_stacks_as_set_checkpoint_takes_them():
    result = plan_on(
        _bench(), GRAD, MODEL, X, budget_bytes="1GiB", candidates=["nothing"]
    )
    assert result.stacks == PATHS
    model = er.set_checkpoint(MODEL, dict.fromkeys(result.stacks, "dots"))
    assert model.encoder.checkpoint == model.decoder.checkpoint == "dots"


def test_a_stack_is_spelled_one_way_in_progress_errors_and_results(capsys):
    # As `set_checkpoint` and the result take it: from inside the model.
    bench = Bench(
        Target(None, figures=_CPU),
        True,
        say=Progress("verbose"),
        cache=CACHE,
        clock=_fake_clock,
        warm=lambda programs: 0.0,
    )
    with pytest.raises(ValueError, match="No candidate fits") as e:
        plan_on(bench, GRAD, MODEL, X, budget_bytes=1)
    err = capsys.readouterr().err
    for text in (str(e.value), err):
        assert "'.encoder.checkpoint'" in text or ".encoder.checkpoint (" in text
        assert "[0]." not in text, text


def test_the_greedy_over_the_hulls_is_no_worse_than_any_uniform_pair():
    # Hand-made prices of two stacks (no compile): every plan the solver
    # returns is predicted to fit, and costs no more than the cheapest pair
    # of uniform options predicted to fit.
    def options(scale):
        return tuple(
            Option(c, b * scale, 0.0, 0.0, t * scale, 0)
            for c, b, t in (
                (None, 10.0, 1.0),
                ("dots", 6.0, 1.5),
                ("nothing", 2.0, 3.0),
            )
        )

    stacks = (Stack(".a", 6, options(1.0)), Stack(".b", 3, options(4.0)))
    nothing = Option("nothing", 0.0, 0.0, 0.0, 0.0, 0)
    prices = Prices(stacks, (6, 3), (), nothing, ())
    record_base = 100.0

    def cost(plan):
        return sum(
            (s.depth - n) * lo.time + n * hi.time
            for s, (lo, hi, n) in zip(stacks, plan)
        )

    def memory(plan):
        return record_base + sum(
            (s.depth - n) * lo.bytes + n * hi.bytes
            for s, (lo, hi, n) in zip(stacks, plan)
        )

    lightest = [Part(s.options[2], s.options[2], 0) for s in stacks]
    for budget in np.linspace(memory(lightest) - 10, 300, 25):
        m = _with_base(CostModel(prices, Evidence(int(budget)), _CPU), record_base)
        got = best_plan(m)
        pairs = [
            (Part(a, a, 0), Part(b, b, 0))
            for a, b in itertools.product(stacks[0].options, stacks[1].options)
        ]
        fitting = [p for p in pairs if memory(p) <= int(budget)]
        if not fitting:
            assert got is None
            continue
        assert got is not None
        plan, predicted = got
        assert memory(plan) <= int(budget) + 1e-9
        assert predicted == pytest.approx(memory(plan))
        assert cost(plan) <= min(map(cost, fitting)) + 1e-9
        assert m.time(plan)[0] == pytest.approx(cost(plan))
        # Against every plan with one stack mixed (two options over its
        # layers) and the other uniform: no worse than the best of them by
        # more than one layer's step on a stack (the rounding).
        mixed = [p for p in _one_stack_mixed(stacks) if memory(p) <= int(budget)]
        step = max(s.depth and (s.options[2].time - s.options[0].time) for s in stacks)
        assert cost(plan) <= min(map(cost, mixed)) + step + 1e-9


def _one_stack_mixed(stacks):
    """Every plan of the two stacks with one stack on two options (`n` layers
    of the second) and the other on one."""
    out = []
    for k in range(2):
        mix, other = stacks[k], stacks[1 - k]
        for a, b, o in itertools.product(mix.options, mix.options, other.options):
            for n in range(mix.depth + 1):
                plan = [None, None]
                plan[k], plan[1 - k] = Part(a, b, n), Part(o, o, 0)
                out.append(tuple(plan))
    return out


def _with_base(m: CostModel, base: float) -> CostModel:
    """`m` whose base memory is `base` (as if learnt from compiled plans)."""

    class Known(CostModel):
        def base(self, plan):
            return base

    return Known(m.prices, m.evidence, m.hardware)


def test_the_flops_of_a_plan_of_several_stacks_are_the_functions():
    # Each stack's option is priced with the others on "nothing": the model's
    # FLOPs of a plan count that base once, as `count_flops` of the function.
    bench = _bench()
    m = CostModel(
        bench.prices(Problem.of(GRAD, (MODEL, X), bench.target)), Evidence(0), _CPU
    )
    for a, b in itertools.product(UNIFORM, UNIFORM):
        plan = tuple(
            Part(o, o, 0) for o in (m.stacks[0].option(a), m.stacks[1].option(b))
        )
        c = er.PerStack({PATHS[0]: a, PATHS[1]: b})
        flops = er.count_flops(GRAD, er.set_checkpoint(MODEL, c), X)
        assert m.flops(plan) == pytest.approx(int(flops), rel=1e-9), (a, b)
