"""The planner's thresholds, in one place: each one a decision, with why it is
what it is (as JAX's `config.py` states every flag with its help text)."""

# --- the model's error bars ---------------------------------------------------------

MODEL_ERROR = 0.05
"""How far above the budget the model may put a uniform option that fits when
compiled, at least: options of equal, or nearly equal, per-layer bytes can
differ by a few percent once XLA assigns their buffers."""

TIME_ERROR = 0.10
"""How far the roofline, scaled to the clock, may be from a program's measured
time, at least (more where a timed option says so): programs doing the same
work run up to ~8% apart as compiled (issue 50), and on transformer-w a floor
of 5% left out an option 6% faster than the pick."""

SAME_PRICE = 1e-3
"""Options that keep the same bytes for FLOPs and a roofline time this close
(relatively) are one program to the model: tracing cannot tell them apart."""

# --- the clock ------------------------------------------------------------------------

RULED_OUT = 0.03
"""A race's margin: a program this much slower than one needing no more memory
has no place on the time-memory frontier that the noise of a few rounds could
give it; and rivals timed within it of the pick are raced again."""

RIVALS = 3
"""At most this many rivals race the pick (those within `RULED_OUT` of the
fastest): each more shares the same time left of the compiles, for fewer
rounds of every program."""

TIME_ROUNDS = 21
"""At most this many interleaved rounds time a call's programs (at least two,
the fewest whose times mean anything; more while they fit in the time this
call's compiles took)."""

RACE_ROUNDS = 31
"""At most this many rounds in a race (as many as fit in what is left of the
compile time): a race decides between programs within `RULED_OUT` of each
other, so it runs longer than a first timing."""

# --- the search -----------------------------------------------------------------------

MIX_TRIES = 6
"""A call compiles at most this many mixes that do not fit, then chooses among
uniform options (each compile of a large model on TPU v5e takes minutes)."""

UNIFORM_RIVALS = 4
"""With several stacks: how many plans of one option per stack, estimated
fastest among those that may fit, are compiled (and timed) beside the pick:
rounding the mix to whole layers can cost more than another choice of whole
options, and the clock may rank those plans otherwise than the model."""

MOST_UNIFORM_PLANS = 4096
"""With several stacks: above this many plans of one option per stack, only
the lower-hull options are combined: the product grows with every stack's
option count (three stacks of 16 options are 4096 plans), and the fastest
plans that fit are plans of hull options."""

# --- the batch planner ----------------------------------------------------------------

CLOSE_WAYS = 0.01
"""Ahead of time (the roofline), ways of running the batch estimated within
this of the least time are a tie, won by the fewest micro-batches: the
roofline does not see what a smaller micro-batch costs a chip."""

RACED_WAYS = 4
"""On the device at hand, the best checkpoints of this many ways (the fastest)
race on one clock: each way timed on a clock of its own, so every one of them
races, not only those close to the fastest."""

FASTER_TRIES = 2
"""For each way after the one solved in full: at most this many options are
compiled there beside its pick (faster than it where solved; where the pick
does not fit there, the fastest that may): each way costs a few compiles, not a
search of its own."""
