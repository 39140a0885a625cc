"""Semi-public helpers: for the zoo and the benchmarks, not for users.

Equinox's convention (`equinox.internal`): these names are importable and tested,
but they are not part of the public contract and may change without notice.
"""

from ._memory import compiled_report as compiled_report
from ._plan import needed_bytes as needed_bytes
from ._util import format_flops as format_flops, is_array_like as is_array_like
