"""Diagnosis: evidence about an ended attempt (error report, exit, cgroup, stderr, NVML) becomes a
``Failure``.
"""
