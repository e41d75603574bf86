"""Diagnosis: evidence about an ended attempt (report, exit, cgroup, stderr, NVML) becomes a ``Failure``."""
