"""One process of a multi-process JAX run on this machine (started, two at a time,
by tests/test_multihost.py through tests/multihost_helpers.py).

    python tests/_multihost_check.py grads OUT_DIR
    python tests/_multihost_check.py inspect OUT_DIR

The environment names the coordinator and this process (`JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`) and its CPU devices (`XLA_FLAGS`). Each
process writes what it computed to `OUT_DIR/<check>-<process>.npz` / `.json`, for
the test to compare across processes and with one process; it prints `ok` last.

- `grads`: every zoo model under a policy, a depth schedule, `ranges(...)` and an
  offloading policy; the parameters FSDP-sharded over the devices of every
  process, the batch split over the processes (each holds only its own rows);
  the loss and the gradients, gathered whole.
- `inspect`: `memory_report` and `plan` of an FSDP gradient, first on process 0
  alone (the other waits at a barrier: nothing in them may wait for the other
  processes), then on every process.
"""

import json
import os
import sys
import traceback
from pathlib import Path


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_remat  # noqa: E402
import zoo  # noqa: E402


BATCH = 8  # split over the processes, then over each one's devices
VOCAB, SEQ = 32, 9


def models() -> dict[str, tuple[eqx.Module, str]]:
    """The zoo, tiny: each model (the same on every process: its key) and the kind
    of its input. Three layers each, so that `ranges` has two parts."""
    return {
        "mlp": (zoo.MLP(8, 8, 16, 3, key=jr.key(0)), "float"),
        "chain": (zoo.ResidualChain(8, 3, key=jr.key(1)), "float"),
        "transformer": (zoo.Transformer(VOCAB, SEQ, 16, 2, 3, key=jr.key(2)), "tokens"),
        "llama": (
            zoo.Transformer.llama(VOCAB, SEQ, 16, 4, 3, key=jr.key(3)),
            "tokens",
        ),
    }


def checkpoints() -> dict[str, eqx_remat.Checkpoint]:
    return {
        "dots": "dots",
        "recursive": eqx_remat.recursive(),
        "ranges": eqx_remat.ranges((2, "nothing"), (1, eqx_remat.every(1, "dots"))),
        "offload": "offload_dots_no_batch",
    }


def batch_of(kind: str) -> np.ndarray:
    """The global batch of an input kind (NumPy, the same on every process)."""
    rng = np.random.default_rng(0)
    if kind == "tokens":
        return rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    return rng.normal(size=(BATCH, 8)).astype(np.float32)


def loss(model, x):
    if x.dtype == jnp.int32:
        logits = jax.vmap(model)(x[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, x[:, 1:, None], axis=-1))
    return jnp.mean(jax.vmap(model)(x) ** 2)


def mesh():
    return jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))


def local_batch(x: np.ndarray, m) -> jax.Array:
    """The global batch `x` as one array split over the mesh, built from this
    process's rows only."""
    n, i = jax.process_count(), jax.process_index()
    rows = x[i * len(x) // n : (i + 1) * len(x) // n]
    sharding = NamedSharding(m, P("data", *[None] * (x.ndim - 1)))
    return jax.make_array_from_process_local_data(sharding, rows, x.shape)


def gathered(tree) -> list[np.ndarray]:
    return [
        np.asarray(multihost_utils.process_allgather(x, tiled=True))
        for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    ]


def check_grads(out: Path) -> None:
    m = mesh()
    results: dict[str, np.ndarray] = {}
    for name, (model, kind) in models().items():
        x = local_batch(batch_of(kind), m)
        # Each process holds half of the batch, on its own devices.
        assert not x.is_fully_addressable
        assert [s.data.shape[0] for s in x.addressable_shards] == [2, 2], name
        for label, ck in checkpoints().items():
            sharded = zoo.shard(eqx_remat.set_checkpoint(model, ck), m, fsdp=True)
            params = jax.tree.leaves(eqx.filter(sharded, eqx.is_array))
            assert any("data" in p.sharding.spec for p in params), name

            @eqx.filter_jit
            def grad(model, x):
                value, grads = eqx.filter_value_and_grad(loss)(model, x)
                return value, zoo.shard(grads, m, fsdp=True)

            value, grads = grad(sharded, x)
            for g, p in zip(jax.tree.leaves(grads), params, strict=True):
                assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (name, label)
            key = f"{name}/{label}"
            results[f"{key}/loss"] = np.asarray(value)
            for j, g in enumerate(gathered(grads)):
                results[f"{key}/{j}"] = g
    np.savez(out / f"grads-{jax.process_index()}.npz", **results)


def report_fields(r: eqx_remat.MemoryReport) -> dict:
    return {
        "temp_bytes": r.temp_bytes,
        "argument_bytes": r.argument_bytes,
        "output_bytes": r.output_bytes,
        "host_temp_bytes": r.host_temp_bytes,
        "flops": int(r.flops),
    }


def plan_fields(p: eqx_remat.PlanResult) -> dict:
    """The answer: the pick, its compiled memory, the frontier's checkpoints."""
    return {
        "checkpoint": repr(p.checkpoint),
        "memory_bytes": p.entry.memory_bytes,
        "fits": p.entry.fits,
        "frontier": [repr(f.checkpoint) for f in p.frontier],
    }


def check_inspect(out: Path) -> None:
    m = mesh()
    model = zoo.Transformer(VOCAB, SEQ, 16, 2, 4, key=jr.key(4))
    model = zoo.shard(model, m, fsdp=True)
    x = local_batch(batch_of("tokens"), m)

    def report(checkpoint) -> eqx_remat.MemoryReport:
        with_checkpoint = eqx_remat.set_checkpoint(model, checkpoint)
        return eqx_remat.memory_report(eqx.filter_grad(loss), with_checkpoint, x)

    def inspect() -> dict:
        # A new function each time: the planner keeps what it learnt about a
        # function for later calls, and each call here must start afresh.
        grad = eqx.filter_grad(loss)
        dots = report("dots")
        # Half-way between the lightest and the heaviest option: a mix.
        low, high = report("nothing").total_bytes, report(None).total_bytes
        budget = (low + high) // 2
        picked = eqx_remat.plan(grad, model, x, budget_bytes=budget, progress=False)
        return {"report": report_fields(dots), "budget": budget, **plan_fields(picked)}

    alone = None
    if jax.process_index() == 0:
        alone = inspect()
    multihost_utils.sync_global_devices("process 0 inspected alone")
    together = inspect()
    path = out / f"inspect-{jax.process_index()}.json"
    path.write_text(json.dumps({"alone": alone, "together": together}))


def main() -> None:
    check, out = sys.argv[1], Path(sys.argv[2])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]),
        initialization_timeout=60,
        heartbeat_timeout_seconds=60,
    )
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    try:
        assert jax.process_count() == 2, jax.process_count()
        assert jax.device_count() == 4, jax.devices()
        {"grads": check_grads, "inspect": check_inspect}[check](out)
        multihost_utils.sync_global_devices(f"{check} done")
    except BaseException:
        # Exit at once: JAX's orderly shutdown would wait for the other process,
        # itself waiting for this one (at a barrier, in a collective). Gone, this
        # process ends the other too, and the test sees the failure now.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    print("ok", flush=True)


if __name__ == "__main__":
    main()
