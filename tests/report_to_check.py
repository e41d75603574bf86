"""The TensorBoard pass-through test's torch side (tests only): ``python report_to_check.py SPEC``.

Prints, as JSON, what the recipe hands the Trainer for ``train.report_to``: SFTConfig's
``report_to`` and the environment of :func:`recipe.report_env` (or the ConfigError's text).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from qlora_supervise.trainer_child.contract.spec import AttemptSpec
from qlora_supervise.trainer_child.recipe import qlora as recipe
from qlora_supervise.trainer_child.run.failure import ConfigError

spec = AttemptSpec.from_json(Path(sys.argv[1]).read_text())
try:
    env = recipe.report_env(spec)
except ConfigError as error:
    print(json.dumps({"error": str(error)}))
    sys.exit(0)
config = recipe.sft_config(spec, recipe.torch.float32, on_cuda=False, has_eval=False)
print(json.dumps({"report_to": config.report_to, "env": env}))
