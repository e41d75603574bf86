"""The commands people type: ``run``, ``status``, ``validate``, ``classify``, ``demo`` and the CLI that
dispatches them.
"""
