"""Planning: pick the checkpoint that fits a memory budget at the least cost.
The entry (`_api`), the planner's stages (`_plan`), its records (`_compiled`,
`_cache`), its solver, the hardware table, the clock, the report, and the
search over micro-batches and loss chunking (`_batch`)."""
