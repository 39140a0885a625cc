"""Inspection: the jaxpr toolkit, FLOP counts, memory reports and targets, the
residuals a function saves, and the costs of Pallas kernels. Reads programs; never
changes how they are differentiated."""
