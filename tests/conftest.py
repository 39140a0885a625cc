import os


# Tests run on the CPU even where libtpu is installed (the `tpu` extra): libtpu is
# used only to compile for TPU v5e ahead of time, never as a runtime backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for every process of a test run: both of
# pytest-xdist's workers, the docs pages and benchmark scripts the tests start (they
# inherit this environment), and CI's later stages (`-m heavy`, `-m slow`), so a
# program that one of them compiled is read back by the others, not compiled again.
# Only compiling is skipped: the executable read back is the one XLA built, and its
# `memory_analysis()`, which the memory tests read, is the same. Set in the
# environment, before jax is imported, so that subprocesses use it too; in the
# repository's ignored `.jax_cache/` unless JAX_COMPILATION_CACHE_DIR says where
# (delete it at will). Every program is kept, however fast it compiled: the same
# small programs are compiled by many tests.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache"
    ),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# Every process of a test run compiles without LLVM's optimisations (the flags
# that tests/zoo_helpers.py's `quick_jit` passes, here for this process and every
# process it starts): compiles for the CPU take a half to two thirds of the time
# on two cores. Nothing a test checks changes: XLA's optimised HLO, its buffers
# and so `memory_analysis()` are the same with and without them (seen on every
# checkpoint of a transformer's gradient and on an FSDP step's HLO text), and so
# are the TPU v5e compiles, figures and compile times alike; only the CPU's
# machine code differs, which computes the same values to float rounding and
# runs slower (the tests time nothing). The docs pages print their figures, and
# test_docs.py holds them to what the pages say.
QUICK_XLA_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)
_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(
    [*_flags, *(f for f in QUICK_XLA_FLAGS if f not in _flags)]
)

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402


# ...except the programs compiled for TPU v5e ahead of time: jax 0.10.2 writes them
# to the cache but cannot read them back (the compile-only client that libtpu
# gives has no runtime to load them into; reading one warns "Error reading
# persistent compilation cache entry ... PjRtCompiler must be constructed with a
# Client"), so that client is kept away from the cache: it compiles every time.
try:
    from jax._src.compilation_cache import _UNSUPPORTED_RUNTIMES
except ImportError as e:  # a jax that moved it: say so, rather than warn per test
    raise ImportError(
        "tests/conftest.py: jax._src.compilation_cache._UNSUPPORTED_RUNTIMES is gone "
        "in this jax; keep TPU compile-only programs out of the persistent "
        "compilation cache another way"
    ) from e
_UNSUPPORTED_RUNTIMES.add("compile_only_runtime")


# Eight CPU devices in this process, for the multi-device tests (set before JAX
# first initialises its backends, as Equinox's conftest does). A test that depends
# on one device says so: it uses `jax.devices()[0]` or a mesh of one device.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

# EQX_REMAT_TEST_REMAT3=1: the whole run with JAX's remat3 (`jax_remat3=True`,
# off by default up to jax 0.12.1, and by JAX's docs on its way to becoming the
# default), so that CI runs the core tests once more on it.
if os.environ.get("EQX_REMAT_TEST_REMAT3", "0") not in ("", "0"):
    if os.environ["EQX_REMAT_TEST_REMAT3"] != "1":
        raise ValueError(
            "EQX_REMAT_TEST_REMAT3 expected '1' (remat3 on) or '0' (off). Got "
            f"{os.environ['EQX_REMAT_TEST_REMAT3']!r}."
        )
    jax.config.update("jax_remat3", True)

# Compiles are slow on two cores: bound the number of examples, and never fail
# a property for being slow.
settings.register_profile(
    "ci",
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_itemcollected(item):
    """The tests of a module that share a module-scoped fixture of it run in one
    pytest-xdist worker (`--dist loadgroup`, in pyproject.toml's addopts), so that
    the fixture — a plan, a training run — is built once, not once per worker.

    Marked as each test is collected: pytest-xdist reads the `xdist_group` marks
    in its own `pytest_collection_modifyitems`, which runs before this file's (a
    mark added there came too late, and each worker built the fixture)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    module = item.nodeid.split("::")[0]
    if any(
        defs and defs[-1].scope == "module" and defs[-1].baseid == module
        for defs in info.name2fixturedefs.values()
    ):
        item.add_marker(pytest.mark.xdist_group(module))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """A docs page's quick case (its blocks before `<!-- docs: slow -->`) is the start
    of its `[all]` case, which runs the same blocks and checks the same outputs:
    where both are selected (CI's `-m "heavy or slow"`), only `[all]` runs. After
    `-m` has deselected what it deselects (`trylast`): a quick case is dropped only
    for an `[all]` case that runs."""
    docs = [
        item
        for item in items
        if item.nodeid.startswith("tests/test_docs.py::test_page_code_runs[")
    ]
    names = {item.name for item in docs}
    covered = [item for item in docs if item.name[:-1] + "[all]]" in names]
    if covered:
        config.hook.pytest_deselected(items=covered)
        items[:] = [item for item in items if item not in covered]
