"""Inspection: the jaxpr toolkit, FLOP counts, memory reports and targets, the
collectives a partitioned program runs, the residuals a function saves, the costs
of Pallas kernels, and the clock that times compiled programs. Reads and runs
programs; never changes how they are differentiated."""
