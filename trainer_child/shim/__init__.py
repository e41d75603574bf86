"""The shim: our heartbeats, error report and emergency save inside a trainer that is not ours,
started with ``site/`` on its ``PYTHONPATH``; nothing runs unless :data:`SHIM_SPEC_ENV` is set."""

#: The variable naming the attempt's ``spec.json``.
SHIM_SPEC_ENV = "QLORA_SUPERVISE_SHIM_SPEC"
