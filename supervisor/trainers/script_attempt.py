"""A ``script`` attempt's files: the knobs the shim changes, learnt against what the script asks for.

What the script asks for is what its attempts reported (the ``script_knobs`` event: attempt 1
changes nothing, so it reports the script as written). A knob of the attempt that differs from it
is named in ``script-knobs.json``; its diff line says ``key: asked -> planned``, and once the
attempt has run ``status`` shows what the shim found and did there instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qlora_supervise.trainer_child.contract import script_knobs
from qlora_supervise.trainer_child.contract.events import ScriptKnobs, read_events
from qlora_supervise.trainer_child.contract.script_knobs import KnobSetting, ScriptChanges
from qlora_supervise.trainer_child.contract.spec import Knobs

EVENTS = "child-events.jsonl"  # record.rundir.AttemptDir.events: the child's file in its folder


def report(attempt_dir: Path) -> ScriptKnobs | None:
    """The attempt's ``script_knobs`` event: what its script built (None: no report)."""
    found = [e for e in read_events(attempt_dir / EVENTS) if isinstance(e, ScriptKnobs)]
    return found[-1] if found else None


def reported(attempt_dir: Path) -> tuple[KnobSetting, ...] | None:
    """What the attempt's script built, as its shim reported it (None: no report)."""
    event = report(attempt_dir)
    return event.settings if event is not None else None


def asked_by_script(run_dir: Path) -> tuple[dict[str, script_knobs.Value], bool]:
    """What the script asks for, each knob from the newest attempt that reported it ({}: none has
    yet; an attempt that failed while loading reported only what it had built by then), and
    whether any attempt reached ``train()`` (then a knob never reported is one it never builds)."""
    asked: dict[str, script_knobs.Value] = {}
    complete = False
    for attempt_dir in sorted(run_dir.glob("attempt-[0-9][0-9][0-9]")):
        event = report(attempt_dir)
        if event is not None:
            asked.update(script_knobs.asked(event.settings))
            complete = complete or event.complete
    return asked, complete


def built_knobs(knobs: Knobs, run_dir: Path) -> Knobs:
    """``knobs`` with what the script asks for, as its attempts in ``run_dir`` reported it."""
    return script_knobs.with_values(knobs, asked_by_script(run_dir)[0])


def write_changes(
    attempt_dir: Path, run_dir: Path, before: Mapping[str, Any], knobs: Knobs, output_dir: Path
) -> dict[str, Any]:
    """``script-knobs.json`` for the attempt; returns the knobs it changes, each with what was asked.
    ``before``: the ladder's knobs as the job holds them, for a knob a script that reached
    ``train()`` never reported (the shim then says nothing of the script takes it, and the ladder
    moves on). Before any attempt reached it, only knobs the script reported change: a default
    halved is not the script's value halved (the effective batch would change)."""
    asked, complete = asked_by_script(run_dir)
    asked = {**before, **asked} if complete else asked
    changed = {name: value for name, value in asked.items() if getattr(knobs, name) != value}
    replaced = str(asked["model"]) if "model" in changed else None  # its tokenizer follows it
    ScriptChanges(tuple(changed), str(output_dir), replaced).write(attempt_dir)
    return changed


def status_lines(attempt_dir: Path) -> list[str] | None:
    """What the attempt's script asked for and got, where it differs or could not be changed."""
    settings = reported(attempt_dir)
    if settings is None:
        return None
    # The output folder moves on every attempt (as a tool's does): not a change worth a line.
    return [s.line() for s in settings if (s.asked != s.got or s.why_not) and s.knob != "output_dir"]
