"""One attempt, start to end: heartbeat, memory caps, failure report, device, torchrun ranks, warm spare."""
