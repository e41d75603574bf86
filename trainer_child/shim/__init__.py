"""The shim: our heartbeats, error report and emergency save inside a trainer that is not ours.

The supervisor starts a foreign tool with ``site/`` on its ``PYTHONPATH`` and the spec named in
:data:`SHIM_SPEC_ENV`; ``site/sitecustomize.py`` has :mod:`.attach` patch ``Trainer.train`` once
``transformers.trainer`` is imported (:mod:`.session`). Nothing runs unless that variable is set."""

#: The variable naming the attempt's ``spec.json`` (set by the supervisor, supervisor/trainers/launch.py).
SHIM_SPEC_ENV = "QLORA_SUPERVISE_SHIM_SPEC"
