"""Pure policy: rungs, ladders, the decision, the memory model. No I/O, no torch."""
