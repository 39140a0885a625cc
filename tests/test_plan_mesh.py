"""`plan(..., shard=)`: the planner chooses the mesh too, every split of the
chips between data parallelism and FSDP, by the clock on the device at hand
(the 8 host devices the tests run with; the clock is fake, as test_plan.py's)
or, ahead of time, by the roofline plus what each chip sends in collectives."""

import equinox as eqx
import jax
import pytest
from helpers import check_close, needs_libtpu

import eqx_remat as er
import zoo
from eqx_remat._inspect._targets import Target
from eqx_remat._planning.testing import Bench, PlanCache, plan_on
from eqx_remat.internal import Hardware, Timing, hardware


def _fake_clock(programs, *, rounds, warmup=True, **race):
    # Step time from FLOPs and temporaries, as test_plan.py's fake clock.
    return [
        Timing(p.record.flops * 1e-10 + p.record.report.temp_bytes * 1e-13, 0.0, rounds)
        for p in programs
    ]


CPU = Target(None, figures=Hardware("cpu", 1e10, 1e10, None, None, ""))
MODEL = zoo.Transformer(64, 16, 16, 2, 2, key=jax.random.key(0))
TOKENS = jax.random.randint(jax.random.key(1), (8, 17), 0, 64)


def _loss(model, tokens):
    return jax.vmap(model.loss)(tokens[:, :-1], tokens[:, 1:]).mean()


GRAD = eqx.filter_grad(_loss)


def _shard(model, tokens):
    """`shard` for `plan`: the parameters and their gradients split over
    "fsdp", the batch over both axes."""

    def on(mesh):
        step = lambda m, t: zoo.shard(GRAD(m, t), mesh, fsdp=True, axis="fsdp")
        placed = zoo.shard(model, mesh, fsdp=True, axis="fsdp")
        return step, (placed, zoo.shard_batch(tokens, mesh, axis=("data", "fsdp")))

    return on


def _names(mesh) -> dict[str, int]:
    return dict(mesh.shape)


def test_every_split_of_the_chips_fsdp_over_all_first():
    meshes = CPU.meshes()
    assert jax.device_count() == 8
    assert [_names(m) for m in meshes] == [
        {"data": 1, "fsdp": 8},
        {"data": 2, "fsdp": 4},
        {"data": 4, "fsdp": 2},
        {"data": 8, "fsdp": 1},
    ]


@pytest.mark.heavy
def test_on_the_device_at_hand_the_clock_chooses_the_mesh():
    """Every mesh that fits is listed with its pick, the fastest by the
    (fake) clock is the plan's, which fits; `shard(result.mesh)` with
    `apply` runs it, with the gradients of the model on one device."""
    shard = _shard(MODEL, TOKENS)
    bench = Bench(
        CPU, True, cache=PlanCache(), clock=_fake_clock, warm=lambda programs: 0.0
    )
    r = plan_on(bench, GRAD, MODEL, TOKENS, budget_bytes="256MiB", shard=shard)
    assert [_names(b.mesh) for b in r.batches] != []
    assert {tuple(_names(b.mesh).values()) for b in r.batches} == {
        (1, 8),
        (2, 4),
        (4, 2),
        (8, 1),
    }
    assert all(b.measured for b in r.batches)
    fastest = min(r.batches, key=lambda b: b.time_s)
    assert fastest.mesh is r.mesh and fastest.checkpoint == r.checkpoint
    assert r.entry.fits and r.entry.memory_bytes <= r.budget_bytes
    assert "mesh=data" in str(r)
    step, (model, tokens) = shard(r.mesh)
    got = eqx.filter_jit(step)(r.apply(model), tokens)
    want = GRAD(MODEL, TOKENS)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        check_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.heavy
def test_a_mesh_the_solved_pick_does_not_fit_gets_a_lighter_option():
    """At the budget of `"nothing"` under data parallelism (the parameters
    whole on every chip), FSDP over every chip, solved first, picks a faster
    option that does not fit data parallelism: that mesh is still listed, with
    a lighter option that fits it."""
    shard = _shard(MODEL, TOKENS)
    meshes = CPU.meshes()

    def memory(c, mesh):
        step, args = shard(mesh)
        return er.memory_report(step, *er.set_checkpoint(args, c)).total_bytes

    budget = memory("nothing", meshes[-1])
    bench = Bench(
        CPU, True, cache=PlanCache(), clock=_fake_clock, warm=lambda programs: 0.0
    )
    r = plan_on(bench, GRAD, MODEL, TOKENS, budget_bytes=budget, shard=shard)
    (solved,) = [b for b in r.batches if b.mesh is meshes[0]]
    assert memory(solved.checkpoint, meshes[-1]) > budget  # it does not fit there
    (dp,) = [b for b in r.batches if b.mesh is meshes[-1]]
    assert dp.checkpoint != solved.checkpoint and dp.memory_bytes <= budget
    assert all(b.memory_bytes <= budget for b in r.batches)


@needs_libtpu
@pytest.mark.heavy
def test_ahead_of_time_a_mesh_is_priced_with_its_collectives():
    """Compiled for v5e:2x2 without a TPU: each mesh's estimate is its pick's
    roofline plus the bytes each chip sends in collectives at the chip's ICI
    rate; the pick is the least of them, and a note says by how much it beats
    FSDP over every chip."""
    model = eqx.filter_eval_shape(lambda: MODEL)
    tokens = jax.ShapeDtypeStruct(TOKENS.shape, TOKENS.dtype)
    shard = _shard(model, tokens)
    r = er.plan(
        GRAD,
        model,
        tokens,
        budget_bytes="1GiB",
        target="v5e:2x2",
        shard=shard,
        progress=False,
    )
    assert {tuple(_names(b.mesh).values()) for b in r.batches} == {
        (1, 4),
        (2, 2),
        (4, 1),
    }
    assert not any(b.measured for b in r.batches)
    assert r.mesh is min(r.batches, key=lambda b: b.time_s).mesh
    ici = hardware("v5e")[0].interconnect_bytes_per_s
    step, args = shard(r.mesh)
    with jax.set_mesh(r.mesh):
        roofline = er.internal.roofline_seconds(step, *r.apply(args), target="v5e:2x2")
    sent = r.entry.report.collective_bytes
    assert sent > 0
    assert r.entry.time_s == pytest.approx(roofline + sent / ici, rel=1e-6)
    if _names(r.mesh) != {"data": 1, "fsdp": 4}:
        assert any("as fast as data 1 x fsdp 4" in n for n in r.notes)


@needs_libtpu
@pytest.mark.heavy
def test_a_tensor_axis_shares_each_examples_work():
    """On v5e:2x4, a mesh with a tensor axis of 2 splits each example's layers
    over it: one chip's roofline is about that of 8-way data parallelism
    (the work per chip is an eighth either way; a few unsplit pieces, the
    norms and the embedding, are done on both chips of the axis), not twice
    it, as counting only the batch's 4-way split would make it."""
    model = eqx.filter_eval_shape(lambda: MODEL)
    tokens = jax.ShapeDtypeStruct(TOKENS.shape, TOKENS.dtype)
    seconds = {}
    for tensor in (None, 2):
        mesh = er.v5e_mesh("v5e:2x4", fsdp=2, tensor=tensor)
        m = zoo.shard(model, mesh, fsdp=True, axis="fsdp")
        t = zoo.shard_batch(tokens, mesh, axis=("data", "fsdp"))
        with jax.set_mesh(mesh):
            seconds[tensor] = er.internal.roofline_seconds(GRAD, m, t, target="v5e:2x4")
    assert 0.8 < seconds[2] / seconds[None] < 1.25, seconds


@needs_libtpu
@pytest.mark.heavy
def test_on_several_slices_fsdp_stays_in_a_slice_and_the_network_is_priced():
    """On two v5e:2x2 slices: FSDP over a slice's chips at most, the data axis
    spanning the slices; a mesh's estimate adds what each chip sends other
    slices, at its share of the data center network's rate."""
    model = eqx.filter_eval_shape(lambda: MODEL)
    tokens = jax.ShapeDtypeStruct(TOKENS.shape, TOKENS.dtype)
    shard = _shard(model, tokens)
    target = "2xv5e:2x2"
    r = er.plan(
        GRAD, model, tokens, budget_bytes="1GiB", target=target, shard=shard,
        progress=False,
    )  # fmt: skip
    assert {tuple(_names(b.mesh).values()) for b in r.batches} == {
        (2, 4),
        (4, 2),
        (8, 1),
    }
    hw = hardware(target)[0]
    step, args = shard(r.mesh)
    with jax.set_mesh(r.mesh):
        roofline = er.internal.roofline_seconds(step, *r.apply(args), target=target)
    report = r.entry.report
    assert report.target == target and report.network_bytes > 0
    comm = report.collective_bytes / hw.interconnect_bytes_per_s
    comm += report.network_bytes / hw.network_bytes_per_s
    assert r.entry.time_s == pytest.approx(roofline + comm, rel=1e-6)


def test_bad_shard_is_named():
    # As users call it: the test suite's type-check hook would catch `3` first.
    plan = getattr(er.plan, "__wrapped__", er.plan)
    with pytest.raises(ValueError, match="shard to be None or a function"):
        plan(GRAD, MODEL, TOKENS, budget_bytes="1GiB", shard=3, progress=False)
    with pytest.raises(ValueError, match="shard= it solves. Pass candidates=None"):
        er.plan(
            GRAD,
            MODEL,
            TOKENS,
            budget_bytes="1GiB",
            candidates=["dots"],
            shard=_shard(MODEL, TOKENS),
            progress=False,
        )
    with pytest.raises(ValueError, match=r"shard\(mesh\) to return \(fn, args\)"):
        er.plan(
            GRAD,
            MODEL,
            TOKENS,
            budget_bytes="1GiB",
            shard=lambda mesh: MODEL,
            progress=False,
        )
