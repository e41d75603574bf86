"""The tools the supervisor runs in place of our child: one module each, registered here."""

from __future__ import annotations

from collections.abc import Mapping

from qlora_supervise.supervisor.trainers.tool import Tool
from qlora_supervise.supervisor.trainers.tools import axolotl, hf_script, llamafactory, script, trl_sft

TOOLS: Mapping[str, Tool] = {
    tool.kind: tool for tool in (trl_sft.TOOL, axolotl.TOOL, llamafactory.TOOL, hf_script.TOOL, script.TOOL)
}
