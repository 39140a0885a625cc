"""Collectives of a compiled, partitioned program (`eqx_remat.internal.collectives`,
`MemoryReport.collective_bytes`): the bytes each chip sends per step, loop trip
counts included, on hand-written programs and on the zoo's sharded Transformer
over the 8 CPU devices tests/conftest.py gives this process."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from jax.sharding import AxisType

import eqx_remat
import zoo
from eqx_remat.internal import collectives, is_array_like


# A loop of 6 trips (its condition's counter against a constant, as a TPU
# program has it: no `known_trip_count`) around a loop of 3 (XLA's count, as
# the CPU's has it); an all-gather in each body and one outside, an all-reduce
# of a tuple, a reduce-scatter, an async all-gather and a collective permute.
PROGRAM = """\
HloModule jit_f, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%inner_cond (p: (s32[], f32[16])) -> pred[] {
  %p = (s32[], f32[16]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%inner_body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]) parameter(0)
  %x = f32[2]{0} get-tuple-element(%p), index=1
  %g = f32[16]{0} all-gather(%x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %t = (s32[], f32[16]) tuple(%i, %g)
}

%outer_cond (p: (s32[], f32[16])) -> pred[] {
  %p = (s32[], f32[16]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c.7 = s32[]{:T(128)} constant(6)
  ROOT %lt = pred[] compare(%i, %c.7), direction=LT
}

%outer_body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]) parameter(0)
  %x = bf16[4,8]{1,0:T(8,128)(2,1)} get-tuple-element(%p), index=1
  %g = bf16[16,8]{1,0:T(8,128)(2,1)} all-gather(%x), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %w = (s32[], f32[16]) while(%p), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %t = (s32[], f32[16]) tuple(%i, %g)
}

ENTRY %main (x: f32[2]) -> f32[16] {
  %x = f32[2]{0} parameter(0)
  %g = f32[16]{0} all-gather(%x), channel_id=3, replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}
  %r = (f32[8]{0}, bf16[8]{0}) all-reduce(%x, %x), channel_id=4, replica_groups={}, to_apply=%add
  %s = f32[2]{0} reduce-scatter(%g), channel_id=5, replica_groups=mesh['a'=2,'b'=4], dimensions={0}, to_apply=%add
  %ags = (f32[2]{0}, f32[16]{0}) all-gather-start(%x), channel_id=6, replica_groups=[1,8]<=[8], dimensions={0}
  %agd = f32[16]{0} all-gather-done(%ags)
  %cp = f32[2]{0} collective-permute(%x), channel_id=7, source_target_pairs={{0,1},{1,0}}
  %w = (s32[], f32[16]) while(%t0), condition=%outer_cond, body=%outer_body
  ROOT %out = f32[16]{0} copy(%g)
}
"""  # noqa: E501 (a program's lines, as XLA prints them)


def test_collectives_of_a_program_with_loops_groups_and_async_ops():
    got = collectives(PROGRAM)
    # All-gathers: entry 64 B over 4 chips, async 64 B over 8; the outer body's
    # 256 B over 4 six times; the inner body's 64 B over 8, 6 x 3 times.
    gather = 64 * 3 / 4 + 64 * 7 / 8 + 6 * 256 * 3 / 4 + 18 * 64 * 7 / 8
    assert got.sent == {
        "all-gather": round(gather),
        "reduce-scatter": 7 * 8,  # its 8 B shard, from each of the 7 others
        "all-reduce": round(2 * 48 * 7 / 8),  # 32 + 16 B over every chip
        "all-to-all": 0,
        "collective-permute": 8,
    }
    assert got.unknown_loops == 0
    assert got.total == sum(got.sent.values())


def test_a_loop_whose_trip_count_cannot_be_read_counts_once_and_says_so():
    program = PROGRAM.replace(
        "ROOT %lt = pred[] compare(%i, %c.7), direction=LT",
        'ROOT %lt = pred[] custom-call(%i), custom_call_target="opaque"',
    )
    got = collectives(program)
    assert got.unknown_loops == 1
    gather = 64 * 3 / 4 + 64 * 7 / 8 + 256 * 3 / 4 + 3 * 64 * 7 / 8
    assert got.sent["all-gather"] == round(gather)


def test_a_condition_counting_to_a_bound_inclusive_runs_one_more_trip():
    program = PROGRAM.replace(
        "compare(%i, %c.7), direction=LT", "compare(%c.7, %i), direction=GE"
    )
    assert collectives(program).sent["all-gather"] == round(
        64 * 3 / 4 + 64 * 7 / 8 + 7 * 256 * 3 / 4 + 21 * 64 * 7 / 8
    )


def test_between_slices_a_megascale_send_counts_over_the_slices():
    """A program for several slices sends between them with `send`s to XLA's
    Megascale runtime, one per collective (its kind in an attribute): counted
    as `network`, over the slices, once per loop trip; `sent` keeps what stays
    within a slice."""
    attrs = (
        "is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_"
        'name="xla_megascale_runtime",_xla_megascale_transfer_type="{}"}'
    )

    def send(name, kind, shape):
        return (
            f"  %{name} = ({shape}, u32[], token[]) send(%x, %tok), channel_id=9, "
            + attrs.replace("{}", kind)
            + "\n"
        )

    # In the outer loop (6 trips): an all-reduce of 16 KiB; in the entry: an
    # all-gather of a 1 KiB part and a reduce-scatter of 4 KiB.
    program = PROGRAM.replace(
        "  %w = (s32[], f32[16]) while(%p), condition=%inner_cond",
        send("ar", "ALL_REDUCE", "f32[4,8,128]{2,1,0:T(8,128)}")
        + "  %w = (s32[], f32[16]) while(%p), condition=%inner_cond",
    ).replace(
        "  ROOT %out = f32[16]{0} copy(%g)",
        send("ag", "ALL_GATHER", "bf16[512]{0}")
        + send("rs", "REDUCE_SCATTER", "f32[1024]{0}")
        + "  ROOT %out = f32[16]{0} copy(%g)",
    )
    got = collectives(program, slices=4)
    assert got.network == {
        "all-gather": 3 * 1024,  # the 3 other slices' parts
        "reduce-scatter": 3 * 1024,  # a quarter of 4 KiB to each of 3
        "all-reduce": 6 * round(2 * 16384 * 3 / 4),
        "all-to-all": 0,
        "collective-permute": 0,
    }
    assert got.network_total == sum(got.network.values())
    assert got.sent == collectives(PROGRAM).sent  # within a slice: unchanged
    # One slice: nothing to send between slices (a ring of one).
    assert collectives(program).network_total == 0


# --- the zoo's Transformer, sharded over 8 CPU devices ------------------------------

DEVICES = 8


@pytest.fixture(scope="module")
def sharded():
    """`report(layers, checkpoint, fsdp)`: the memory report of a sharded
    gradient step of a 128-wide Transformer, and its parameters' f32 bytes
    per layer."""
    assert jax.device_count() == DEVICES, jax.devices()
    mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Auto,))

    def loss(model, tokens):
        logits = jax.vmap(model)(tokens[:, :-1])
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    def report(layers, checkpoint, fsdp):
        model = eqx.filter_eval_shape(
            lambda: zoo.Transformer(
                256, 32, 128, 4, layers, checkpoint=checkpoint, key=jr.key(0)
            )
        )
        model = zoo.shard(model, mesh, fsdp=fsdp)
        tokens = zoo.shard_batch(jax.ShapeDtypeStruct((8, 32), jnp.int32), mesh)
        grad = eqx.filter_grad(loss)
        return eqx_remat.memory_report(grad, model, tokens)

    return report


def _layer_bytes(layers: int) -> int:
    model = eqx.filter_eval_shape(
        lambda: zoo.Transformer(256, 32, 128, 4, layers, key=jr.key(0))
    )
    blocks = jax.tree.leaves(eqx.filter(model.blocks, is_array_like))
    return sum(x.size * x.dtype.itemsize for x in blocks) // layers


def test_fsdp_gathers_each_layer_again_where_it_recomputes_it(sharded):
    """Per layer (the difference of 4 layers and 2: trip counts make it linear
    in depth), in `(n - 1) / n` of the layer's f32 bytes: under `None` its
    weights gathered once and its gradients all-reduced (twice that: the
    gradient step's output is not sharded here); under `"nothing"` one more
    gather, for the forward pass the backward pass runs again (a few vectors
    too short to split are not gathered: within 1%)."""
    layer = _layer_bytes(2) * (DEVICES - 1) / DEVICES
    for c, expected in ((None, 3), ("nothing", 4)):
        per_layer = (
            sharded(4, c, True).collective_bytes - sharded(2, c, True).collective_bytes
        ) / 2
        assert per_layer / layer == pytest.approx(expected, rel=0.01), c


def test_data_parallel_all_reduces_the_gradients_and_gathers_no_weights(sharded):
    layer = _layer_bytes(2)
    small, large = sharded(2, None, False), sharded(4, None, False)
    per_layer = (large.collective_bytes - small.collective_bytes) / 2
    # A ring all-reduce of each layer's f32 gradients: twice `(n - 1) / n` of
    # them, and nothing more per layer.
    assert per_layer == pytest.approx(2 * (DEVICES - 1) / DEVICES * layer, rel=0.05)


def test_one_device_sends_nothing():
    report = eqx_remat.memory_report(lambda x: (x**2).sum(), jnp.ones((8, 8)))
    assert report.collective_bytes == 0
