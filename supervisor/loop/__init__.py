"""The loop and its parts: the state machine, the attempt runner, reclaim, the planner, waiting and the
child process.
"""
