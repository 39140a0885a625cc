"""Schedules: how a stack of layers is differentiated. The base class and the
engine that owns the custom derivatives, the checkpoint value (`None`, a policy or
a schedule), and the schedules: uniform splits, binomial, ranges."""
