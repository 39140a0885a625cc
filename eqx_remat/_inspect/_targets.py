"""Target names: what `memory_report`, `plan` and the benchmarks compile for. The
one parser of them: `None` (the default backend), a platform name, or a TPU v5e
slice, `"v5e"` (2x2) or `"v5e:AxB"`."""

import re
from typing import Any


PLATFORMS = ("cpu", "gpu", "tpu")

VALID_TARGETS = (
    'None (the default backend), its platform name ("cpu", "gpu" or "tpu", as '
    'reports name it), "v5e" (TPU v5e 2x2, 4 chips) or "v5e:AxB" (e.g. "v5e:2x4", '
    '"v5e:4x4")'
)

_V5E = re.compile(r"v5e(?::(\d+)x(\d+))?")

# The slice shapes TPU v5e comes in (Cloud TPU's "TPU v5e" page: "v5e supports
# the following 2D slice shapes", with no custom topologies): libtpu describes
# others too (a 2x3 slice), which no one can run on.
V5E_SLICES = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))


def v5e_shape(target: Any) -> tuple[int, int] | None:
    """The slice shape `(A, B)` that a TPU v5e target names: `(2, 2)` for
    `"v5e"`, `(A, B)` for `"v5e:AxB"` (not checked to be a slice v5e comes in:
    `V5E_SLICES`); `None` for any other value.

    ```python
    import eqx_remat

    print(eqx_remat.internal.v5e_shape("v5e:2x4"), eqx_remat.internal.v5e_shape("cpu"))
    ```

    ```text
    (2, 4) None
    ```
    """
    match = _V5E.fullmatch(target) if isinstance(target, str) else None
    if match is None:
        return None
    if match.group(1) is None:
        return 2, 2
    return int(match.group(1)), int(match.group(2))
