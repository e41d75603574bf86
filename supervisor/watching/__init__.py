"""Watching a running attempt: heartbeats, NVML, host RAM and the cgroup, as typed samples."""
