"""The trainer child package stays light to import: the supervisor imports its contract."""

from __future__ import annotations

import subprocess
import sys


def test_package_import_pulls_in_no_heavy_library() -> None:
    """Importing the package and its contract loads neither torch nor transformers, trl, peft."""
    code = (
        "import sys, qlora_supervise.trainer_child, qlora_supervise.trainer_child.contract\n"
        "heavy = {'torch', 'transformers', 'trl', 'peft', 'bitsandbytes', 'datasets'} & set(sys.modules)\n"
        "print(sorted(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_attempt_module_imports_torch_only_when_run() -> None:
    """The attempt, events, failure and checkpoint modules import torch lazily, at run time."""
    code = (
        "import sys\n"
        "import qlora_supervise.trainer_child.run.attempt\n"
        "import qlora_supervise.trainer_child.contract.checkpoints\n"
        "import qlora_supervise.trainer_child.run.memory, qlora_supervise.trainer_child.recipe.tiny\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"
