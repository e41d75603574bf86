"""The memory model's parts; :mod:`qlora_supervise.policies.memory_model` is the public face."""
