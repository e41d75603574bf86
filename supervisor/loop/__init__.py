"""The loop: the state machine, the attempt runner, reclaim, the planner, waiting, the child process."""
