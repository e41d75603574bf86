"""The shim: our heartbeats, error report and emergency save inside a trainer that is not ours.

The supervisor starts a foreign tool (``trl sft``, axolotl, LLaMA-Factory, an HfArgumentParser
script) with ``site/`` on its ``PYTHONPATH`` and the attempt's spec named in
:data:`SHIM_SPEC_ENV`. Python imports ``site/sitecustomize.py`` at start-up; it asks
:mod:`.attach` to wait for ``transformers.trainer`` to be imported and then patches
``Trainer.train``, so that whatever Trainer the tool builds is supervised like ours
(:mod:`.session`). Nothing here runs unless that variable is set.
"""

#: The variable naming the attempt's ``spec.json`` (set by the supervisor, supervisor/trainers/launch.py).
SHIM_SPEC_ENV = "QLORA_SUPERVISE_SHIM_SPEC"
