import os


# Tests run on the CPU even where libtpu is installed (the `tpu` extra): libtpu is
# used only to compile for TPU v5e ahead of time, never as a runtime backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402


# Eight CPU devices in this process, for the multi-device tests (set before JAX
# first initialises its backends, as Equinox's conftest does). A test that depends
# on one device says so: it uses `jax.devices()[0]` or a mesh of one device.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

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
