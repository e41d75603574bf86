"""The job file: its schema (validated once into the specs the child gets), units, world checks and the
data probe.
"""
