"""`plan(..., micro_batches=, loss_chunks=)`: the planner chooses how to run a
global batch (micro-batches, loss chunking and checkpoint) by time per global
batch. Tests never time anything: each plan runs on a bench whose clock is
fake (as test_plan.py's), with the CPU's figures fixed and a cache of its own."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import check_close

import eqx_remat as er
import zoo
from eqx_remat._inspect._targets import Target
from eqx_remat._planning.testing import Bench, PlanCache, Timed, plan_on
from eqx_remat.internal import Hardware, Timing, map_loss_chunk_sizes


def _fake_clock(programs, *, rounds, warmup=True, **race):
    # Step time from FLOPs and temporaries, as test_plan.py's fake clock.
    return [
        Timing(p.record.flops * 1e-10 + p.record.report.temp_bytes * 1e-13, 0.0, rounds)
        for p in programs
    ]


CPU = Target(None, figures=Hardware("cpu", 1e10, 1e10, None, None, ""))


def _bench(measure: bool, cache: PlanCache, bench: type[Bench] = Bench) -> Bench:
    """A `bench` (the class) for the device at hand, with the CPU's figures
    fixed, the fake clock, no warm-up and `cache`."""
    return bench(
        CPU, measure, cache=cache, clock=_fake_clock, warm=lambda programs: 0.0
    )


def _plan(fn, *args, measure=True, cache=None, bench=Bench, **kwargs):
    """`eqx_remat.plan` on a fake bench (`bench`, the class) that measures
    where `measure`, with `cache` (by default, a new one: nothing is
    remembered from other tests)."""
    cache = PlanCache() if cache is None else cache
    return plan_on(_bench(measure, cache, bench), fn, *args, **kwargs)


MODEL = zoo.Transformer(64, 16, 16, 2, 2, key=jax.random.key(0))
TOKENS = jax.random.randint(jax.random.key(1), (8, 17), 0, 64)


def _loss(model, tokens):
    return jax.vmap(model.loss)(tokens[:, :-1], tokens[:, 1:]).mean()


GRAD = eqx.filter_value_and_grad(_loss)


def _lightest(fn) -> int:
    """The least memory of `fn` over the lightest checkpoints."""
    return min(
        er.memory_report(fn, *er.set_checkpoint((MODEL, TOKENS), c)).total_bytes
        for c in (er.recursive(), "nothing")
    )


@pytest.mark.heavy
def test_micro_batches_fit_where_the_whole_batch_does_not():
    """A budget under what the whole batch needs with any checkpoint, over
    what 4 micro-batches need: the pick runs 4 micro-batches (or 2), fits,
    and is the fastest of the combinations it lists; `step` and `apply` run
    the plan, with the same loss and gradients as the whole batch."""
    one, four = _lightest(GRAD), _lightest(er.accumulate(GRAD, 4))
    assert four < one
    budget = (one + four) // 2
    r = _plan(
        GRAD,
        MODEL,
        TOKENS,
        budget_bytes=budget,
        micro_batches=(1, 2, 4),
        loss_chunks=(None, 4),
    )
    assert r.micro_batches in (2, 4)
    assert r.entry.memory_bytes is not None and r.entry.memory_bytes <= budget
    assert r.entry.fits and r.entry.measured
    assert r.batches, r
    assert all(b.micro_batches > 1 and b.memory_bytes <= budget for b in r.batches)
    assert [b.time_s for b in r.batches] == sorted(b.time_s for b in r.batches)
    first = r.batches[0]
    assert (first.micro_batches, first.loss_chunk_size, first.checkpoint) == (
        r.micro_batches,
        r.loss_chunk_size,
        r.checkpoint,
    )
    assert f"micro_batches={r.micro_batches}" in str(r)
    model = r.apply(MODEL)
    assert model.checkpoint == r.checkpoint
    assert model.loss_chunk_size == r.loss_chunk_size
    (loss, grads), (want_loss, want) = r.step(GRAD)(model, TOKENS), GRAD(MODEL, TOKENS)
    check_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    check_close(grads, want, rtol=1e-4, atol=1e-6)


ROOMY = dict(micro_batches=(1, 2), loss_chunks=(4, None))


@pytest.fixture(scope="module")
def roomy():
    """`(budget, result, cache)`: a plan of `ROOMY` at the budget of the whole
    batch's `None` (where every combination fits something), measured on the
    fake clock, from an empty cache, and that cache. Planned once, read by two
    tests: neither changes them (a test that plans again plans on a copy of
    the cache)."""
    cache = PlanCache()
    budget = er.memory_report(GRAD, MODEL, TOKENS).total_bytes
    r = _plan(GRAD, MODEL, TOKENS, budget_bytes=budget, cache=cache, **ROOMY)
    return budget, r, cache


@pytest.mark.heavy
def test_with_room_the_fastest_combination_is_the_pick(roomy):
    """With the budget of the whole batch's `None`, every combination fits
    something: the pick is the least time per global batch of those listed,
    each measured, and the loss chunk planned is the one `apply` sets."""
    _, r, _ = roomy
    assert {(b.micro_batches, b.loss_chunk_size) for b in r.batches} == {
        (1, 4),
        (1, None),
        (2, 4),
        (2, None),
    }
    assert all(b.measured for b in r.batches)
    fastest = min(r.batches, key=lambda b: b.time_s)
    assert (fastest.micro_batches, fastest.loss_chunk_size) == (
        r.micro_batches,
        r.loss_chunk_size,
    )
    assert r.apply(MODEL).loss_chunk_size == r.loss_chunk_size


@pytest.mark.heavy
def test_a_combination_timed_slow_on_its_own_clock_still_races(roomy):
    """Each combination is timed on a clock of its own: the fastest one, whose
    own rounds made it look 20% slower (a busy moment), still races, and the
    race's one clock makes it the pick."""
    budget, plain, cache = roomy
    times = sorted(b.time_s for b in plain.batches)
    assert times[1] < 1.2 * times[0]  # else slowing it moves nothing
    way = (plain.micro_batches, plain.loss_chunk_size)
    slowed = set()

    class Busy(Bench):
        """A bench on which the fastest combination's timings come out 20%
        slower, as if the machine were busy while they were taken."""

        def time(self, problem, cs, ev) -> Timed:
            timed = super().time(problem, cs, ev)
            k = 1 if problem.fn is GRAD else 2
            if (k, map_loss_chunk_sizes(problem.args, lambda c: c)[1][0]) != way:
                return timed
            slowed.update(timed.timings)
            timings = {
                c: t._replace(seconds=1.2 * t.seconds) for c, t in timed.timings.items()
            }
            return timed._replace(timings=timings)

    # The plan again, on a copy of the first one's cache: its compiles and
    # per-combination timings are taken from there (the timings through
    # `Bench.time`, which `Busy` slows as above); the race of the slowed
    # order is not there, and is run afresh.
    again = PlanCache()
    again._entries.update(cache._entries)
    r = _plan(
        GRAD, MODEL, TOKENS, budget_bytes=budget, cache=again, bench=Busy, **ROOMY
    )
    assert slowed
    assert (r.micro_batches, r.loss_chunk_size) == way
    assert r.checkpoint == plain.checkpoint


@pytest.mark.heavy
def test_nothing_fits_with_any_combination():
    """A budget under every combination's lightest: the error says so, with
    the table of the last combination and the counts tried."""
    with pytest.raises(ValueError, match="No candidate fits") as e:
        _plan(
            GRAD,
            MODEL,
            TOKENS,
            budget_bytes=1000,
            micro_batches=(2,),
            measure=False,
        )
    assert "micro-batch counts and loss chunk sizes tried: 2/None" in str(e.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(micro_batches=()), "micro_batches to be a non-empty sequence"),
        (dict(micro_batches=(0,)), "micro_batches must be an int >= 1. Got 0"),
        (dict(micro_batches=(3,)), "micro_batches=3 must divide the batch size"),
        (dict(loss_chunks=(0,)), "loss_chunks must be an int >= 1. Got 0"),
        (dict(micro_batches=(2,), candidates=["dots"]), "Pass candidates=None"),
        (dict(micro_batches=(2,), in_axes=(None, 2)), "gives axis 2 for the array"),
    ],
)
def test_bad_batch_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        er.plan(GRAD, MODEL, TOKENS, budget_bytes="1GiB", progress=False, **kwargs)


@pytest.mark.parametrize(
    "kwargs", [dict(micro_batches=2), dict(loss_chunks=16), dict(candidates="dots")]
)
def test_a_bare_value_is_not_taken_for_a_list(kwargs):
    # As users call it: the test suite's type-check hook (jaxtyping + beartype)
    # would catch the first two by their hints before `plan`'s own check.
    plan = getattr(er.plan, "__wrapped__", er.plan)
    ((name, value),) = kwargs.items()
    with pytest.raises(ValueError, match=f"{name} to be a sequence.* Got {value!r}"):
        plan(GRAD, MODEL, TOKENS, budget_bytes="1GiB", progress=False, **kwargs)


def test_loss_chunks_need_a_loss_head():
    mlp = zoo.MLP(4, 8, 4, 2, key=jax.random.key(0))
    grad = eqx.filter_grad(lambda m, x: jnp.sum(jax.vmap(m)(x)))
    with pytest.raises(ValueError, match="`loss_chunk_size` field"):
        er.plan(
            grad,
            mlp,
            jnp.ones((4, 4)),
            budget_bytes="1GiB",
            loss_chunks=(None, 2),
            progress=False,
        )


def test_loss_chunks_that_change_nothing_are_said():
    # The logits from `__call__`, not `loss`: the chunk size cannot act.
    grad = eqx.filter_grad(lambda m, t: jnp.mean(jax.vmap(m)(t[:, :-1])))
    with (
        pytest.warns(UserWarning, match="=None and 4, so loss_chunks changes nothing"),
        pytest.raises(ValueError, match="No candidate fits"),
    ):
        _plan(
            grad,
            MODEL,
            TOKENS,
            budget_bytes=1000,
            loss_chunks=(None, 4),
            measure=False,
        )


@pytest.mark.heavy
def test_ahead_of_time_the_fewest_micro_batches_within_one_percent():
    """Without the clock (the roofline), the pick is the fewest micro-batches
    among the combinations estimated within 1% of the least time: the
    roofline does not see what a smaller micro-batch costs a chip."""
    budget = er.memory_report(GRAD, MODEL, TOKENS).total_bytes
    r = _plan(
        GRAD,
        MODEL,
        TOKENS,
        budget_bytes=budget,
        micro_batches=(1, 2, 4),
        measure=False,
    )
    assert {b.micro_batches for b in r.batches} == {1, 2, 4}
    assert not any(b.measured for b in r.batches) and not r.entry.measured
    least = min(b.time_s for b in r.batches)
    close = [b for b in r.batches if b.time_s <= 1.01 * least]
    assert r.micro_batches == min(b.micro_batches for b in close)
    assert r.entry.time_s <= 1.01 * least


def test_the_roofline_counts_a_micro_batch_loop_once_per_trip():
    """Inside `accumulate`'s scan over 4 micro-batches, what the stacks save
    is alive one micro-batch at a time (the memory), and written and read
    once per micro-batch (the bytes the roofline charges): 4 times as much."""
    from eqx_remat._inspect._jaxpr import saved_across
    from eqx_remat._planning.testing import stacks_of
    from eqx_remat._util import traceable

    step = er.accumulate(GRAD, 4)
    args = er.set_checkpoint((MODEL, TOKENS), "dots")
    depths = frozenset(d for _, d in stacks_of(step, args))
    f, dynamic = traceable(step, args)
    jaxpr = jax.make_jaxpr(f)(dynamic).jaxpr
    alive = saved_across(jaxpr, depths)[0]
    written = saved_across(jaxpr, depths, per_trip=True)[0]
    assert alive > 0 and written == 4 * alive
    f, dynamic = traceable(GRAD, args)
    whole = saved_across(jax.make_jaxpr(f)(dynamic).jaxpr, depths)[0]
    assert written == whole  # the whole batch's, written once
