"""Planning: pick the checkpoint that fits a memory budget at the least cost. The
planner, its solver, the hardware table and the clock."""
