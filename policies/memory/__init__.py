"""The memory model's parts: the shape it reads, the GPU and host terms, and calibration.

:mod:`qlora_supervise.policies.memory_model` is the public face; import from there.
"""
