"""Python's cyclic garbage collector paused over a block that builds many long-lived objects.

Loading a pair makes containers by the hundred thousand (the model's modules and tensors, the runtime's copies, the
tokenizer's tables) after the imports already hold hundreds of thousands. Each of the collector's full passes scans
all of them, and the allocations trigger one every few thousand containers, so a load spent much of its time in
collections that found almost nothing to free (docs/cpu-speed.md, "Loading a pair"). Reference counting still frees everything not in a cycle at once,
so only cyclic garbage waits for the collector, which runs again as usual after the block.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def gc_paused():
    """Collection off inside the block and back as it was after it (a caller that had it off keeps it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
