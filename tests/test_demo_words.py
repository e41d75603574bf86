"""The demo and the import-baseline probe speak in MiB / GiB to people, and in bytes to scripts.

Issue 21 item 18.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from _machine import scaled

from qlora_supervise.supervisor.commands.demo import DEMO_CPU_HEADROOM, DEMO_GPU_CAP, cap_words
from qlora_supervise.trainer_child.contract.processes import STACK, STACK_BYTES

MIB = 1 << 20


def test_the_demos_cpu_cap_is_said_in_human_units_with_its_origin() -> None:
    """The demo's cap line names MiB / GiB and where the cap comes from, never a raw byte count."""
    baseline = 399_769_600  # the CPU build of torch here: 381.25 MiB
    words = cap_words(baseline)
    assert words == "cpu_memory_limit 1.32 GiB: the trainer's 381.25 MiB after its imports + 970.00 MiB"
    assert not re.search(r"\d{5,}", words)
    assert (baseline + DEMO_CPU_HEADROOM) // MIB == 1351  # the job file's cap, in whole MiB
    assert cap_words(None) == f"gpu_memory_limit {DEMO_GPU_CAP}"


@pytest.mark.slow
def test_the_stack_probe_prints_human_units_and_bytes_on_request() -> None:
    """The stack probe says MiB or GiB; with --bytes it prints the bare byte count its callers parse."""
    person = subprocess.run(
        [sys.executable, "-m", STACK], capture_output=True, text=True, check=True, timeout=scaled(120)
    ).stdout
    said = re.match(r"import baseline: (\d+(?:\.\d+)?) (MiB|GiB) of data segment", person)
    assert said, person
    script = subprocess.run(
        [sys.executable, "-m", STACK, STACK_BYTES],
        capture_output=True,
        text=True,
        check=True,
        timeout=scaled(120),
    ).stdout
    assert script.strip().isdigit() and int(script) > 100 * MIB
    human = float(said.group(1)) * (MIB if said.group(2) == "MiB" else 1024 * MIB)
    assert abs(human - int(script)) < 0.1 * int(script)  # two processes: the same size, give or take
