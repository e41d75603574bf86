"""Pure policy: rungs (knobs -> knobs), ladders per failure kind, the decision, the memory model.

No I/O, no torch. Depends only on ``qlora_supervise.trainer_child.contract``.
"""
