"""The parts of benchmarks/gpu_check.py, in the order they run, with their weights in the time budget.

Each module has `run(ctx)` (ctx: record.Context) and runs in a process of its own; a part's share is
its weight's fraction of the time left when it starts, so what one part leaves over goes to the next.
The demo comes last and gets what remains.
"""

PARTS = (  # (name, weight)
    ("environment", 0.04),
    ("exactness", 0.10),
    ("conversion", 0.36),   # the slowest and least known: SmolLM2 with its search, then a 7B shape
    ("decode", 0.20),
    ("training", 0.14),
    ("serving", 0.06),
    ("demo", 0.10),
)
