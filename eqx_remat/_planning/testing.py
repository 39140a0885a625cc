"""The planner's test seam: the one way tests reach inside the planner.

Tests never time anything and never monkeypatch a module of the planner:
they hand the loop a `Bench` of their own (a fake `clock`, no warm-up, a
`PlanCache` of their own, a `compile` that records or refuses), run `plan_on`
on it, and hold the pure parts (the pricer's pieces, the `CostModel`, the
solver, the search) on hand-made `Evidence`. What they need is named here,
and only here: a test imports `eqx_remat._planning.testing`, never a private
module of the planner (`tests/test_layout.py` checks it). Not part of any
public API: a name here changes with the planner.
"""

from .._inspect._compiled import Compiled as Compiled
from .._roofline import price as price, stacks_of as stacks_of
from ._api import plan_on as plan_on
from ._bench import (
    Bench as Bench,
    Problem as Problem,
    Timed as Timed,
    compile_checkpoint as compile_checkpoint,
    still_open as still_open,
)
from ._cache import CACHE as CACHE, PlanCache as PlanCache
from ._cost import (
    CostModel as CostModel,
    Part as Part,
    best_plan as best_plan,
    floor as floor,
    mix_predictor as mix_predictor,
    point as point,
)
from ._evidence import Evidence as Evidence
from ._loop import Compile as Compile, Time as Time, search as search
from ._prices import (
    Prices as Prices,
    Stack as Stack,
    price_function as price_function,
)
from ._report import FrontierPoint as FrontierPoint, Progress as Progress
from ._solve import (
    Option as Option,
    best_mix as best_mix,
    linear as linear,
    lower_hull as lower_hull,
    pareto as pareto,
)
from ._thresholds import MIX_TRIES as MIX_TRIES, RULED_OUT as RULED_OUT
