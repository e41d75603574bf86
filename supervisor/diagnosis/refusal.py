"""A trainer that refused its config before its first step, told from its stderr alone: an import
failure, its argument parser's refusal (exit 2) or a deterministic exception in setup or load fails
alike on every start, so ``config_error`` (tried once), not ``other`` (a crash loop)."""

from __future__ import annotations

import re

from qlora_supervise.supervisor.diagnosis import _signatures
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage

_IMPORT_FAILED = re.compile(r"^(?:ModuleNotFoundError|ImportError)\b")
#: Exception classes (by their name's last part) that say the same on every start.
_DETERMINISTIC = frozenset(
    {
        "ValueError",
        "TypeError",
        "KeyError",
        "AttributeError",
        "NotImplementedError",
        "FileNotFoundError",
        "NotADirectoryError",
        "IsADirectoryError",
        "SyntaxError",
        "ValidationError",
        "SafetensorError",
        "HeaderTooLarge",
        "OfflineModeIsEnabled",
    }
)
_EXCEPTION_NAME = re.compile(r"^(?:[A-Za-z_]\w*\.)*(?P<name>[A-Za-z_]\w*)")
_USAGE = re.compile(r"^usage: ", re.MULTILINE)
_PARSER_ERROR = re.compile(r"^(?P<line>[\w.\- ]{1,80}: error: .+)$", re.MULTILINE)
ARGPARSE_EXIT = 2
#: Import errors of an interpreter already shutting down follow the failure that ended it.
_AT_EXIT = re.compile(r"Python is likely shutting down|sys\.meta_path is None|^Exception ignored in", re.M)
#: Stages before the first step (UNKNOWN: no heartbeat and no frame says otherwise).
BEFORE_TRAINING = frozenset({Stage.UNKNOWN, Stage.SETUP, Stage.LOAD})
_PLACED_BEFORE_TRAINING = frozenset({Stage.SETUP, Stage.LOAD})

#: Refusals whose fix is known: (the tool's words, the fix).
FIXES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"You need to assign use_cpu|doesn't support bf16/gpu"),
        "no GPU here: write use_cpu: true and bf16: false in the tool's config (docs/trainers-cpu.md)",
    ),
    (
        re.compile(r"Error while deserializing header|HeaderTooLarge|incomplete metadata"),
        "the model file does not load (damaged or cut short): download the model again",
    ),
)


def refused_before_training(
    text: str, stage: Stage, last_stage: Stage, returncode: int | None
) -> Failure | None:
    """The config's failure for ``text`` (a stderr tail judged ``other`` at ``stage``), or None;
    ``last_stage``: the heartbeats' last."""
    if stage not in BEFORE_TRAINING or last_stage not in BEFORE_TRAINING or _AT_EXIT.search(text):
        return None
    lines = [match.group("line").strip() for match in _signatures.EXCEPTION_LINE.finditer(text)]
    last = lines[-1][:300] if lines else None
    if last is not None and _IMPORT_FAILED.match(last):
        fix = "install the package into the trainer's interpreter, trainer.python"
        return _refusal(stage, "an import failure", last, fix)
    parser = _parser_refusal(text) if returncode == ARGPARSE_EXIT else None
    if parser is not None:
        return _refusal(stage, "its argument parser's refusal", parser, _fix(parser))
    placed = stage in _PLACED_BEFORE_TRAINING or last_stage in _PLACED_BEFORE_TRAINING
    named = _EXCEPTION_NAME.match(last) if last is not None else None
    if last is not None and named is not None and placed and named.group("name") in _DETERMINISTIC:
        where = stage if stage is not Stage.UNKNOWN else last_stage
        return _refusal(stage, f"a refusal in {where.value}", last, _fix(last))
    return None


def _parser_refusal(text: str) -> str | None:
    if _USAGE.search(text) is None:
        return None
    found = _PARSER_ERROR.findall(text)
    return found[-1].strip()[:300] if found else None


def known_fix(line: str) -> str | None:
    """The fix :data:`FIXES` knows for a refusal's ``line``, or None."""
    for pattern, fix in FIXES:
        if pattern.search(line):
            return fix
    return None


def _fix(line: str) -> str:
    return known_fix(line) or "fix the value it names in the tool's config"


def _refusal(stage: Stage, what: str, line: str, fix: str) -> Failure:
    why = f"no error report; stderr ends in {what} {line!r} before step 1: the same on every start ({fix})"
    return Failure(FailureKind.CONFIG_ERROR, stage, {}, why, line)
