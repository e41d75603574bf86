"""The ladders: what to change, rung by rung, after a failure."""
