"""One attempt from start to end: the attempt itself, its heartbeat, memory caps, failure report,
device check, torchrun ranks and the warm spare."""
