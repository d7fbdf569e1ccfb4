"""Search over schedules: exact optimisation (CP-SAT, optional) and the memory/bubble frontier."""
