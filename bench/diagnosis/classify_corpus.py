"""Score the failure classifier on a labelled corpus, and the message parser on formats.jsonl.

    python -m bench.diagnosis.classify_corpus [DEV_JSONL] [--formats FORMATS_JSONL] [--show-misses]
        [--fixtures tests/fixtures/diagnosis/issue33-cases.json]

Defaults: ``../shared/corpus/dev.jsonl`` and ``formats.jsonl`` next to it (relative to the
repository root). Prints a confusion table (rows: label, columns: predicted kind), per-kind
recall, kind accuracy over all cases, over cases with the exception line and over the cases
whose text decides the stage, stage accuracy, the number of non-OOM cases called OOM, and the
parser's exact-match score per key. A missing corpus is not an error: a note is printed and the
exit status is 0.

*The text decides the stage* unless the case is labelled with a stage-named OOM kind (load,
forward, backward, optimizer, eval, merge) and its text holds no traceback frame at all (no
``File "...", line N, in f``, IPython or rich frame): a bare message, or a lone code line, whose
stage the labeller took from the report around it (the corpus README's "hard cases"). The
test is on the text's layout only, not on what the classifier makes of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from qlora_supervise.policies.decide import SPURIOUS_KEY
from qlora_supervise.supervisor.diagnosis._frames import parse_frames
from qlora_supervise.supervisor.diagnosis.classify import classify_text
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.oom_message import parse_messages, parse_numbers

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEV = ROOT.parent / "shared" / "corpus" / "dev.jsonl"

# Corpus stage -> the classifier's stages that count as right.
STAGE_MATCH: Mapping[str, frozenset[str]] = {
    "generate": frozenset({"eval"}),
    "predict": frozenset({"eval"}),
    "import": frozenset({"setup"}),
    "training_step": frozenset({"forward", "backward", "optimizer", "unknown"}),
}
ABBREV = {kind.value: kind.value.replace("oom_", "").replace("_cuda_setup", "")[:6] for kind in FailureKind}


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def score_dev(cases: Sequence[dict[str, Any]], show_misses: bool) -> None:
    predicted = [classify_text(case["text"]) for case in cases]
    labels = [case["label"] for case in cases]
    kinds = [failure.kind.value for failure in predicted]
    print_confusion(labels, kinds)
    print_recall(labels, kinds)
    with_line = [i for i, case in enumerate(cases) if not case.get("final_line_missing")]
    print()
    print(f"kind accuracy, all cases:               {_ratio(_hits(labels, kinds, range(len(cases))))}")
    print(f"kind accuracy, with the exception line: {_ratio(_hits(labels, kinds, with_line))}")
    decided = [i for i, case in enumerate(cases) if text_decides_stage(case)]
    print(f"kind accuracy, text decides the stage:  {_ratio(_hits(labels, kinds, decided))}")
    stage_hits = [
        kinds_stage_ok(case["stage"], f.stage.value) for case, f in zip(cases, predicted, strict=True)
    ]
    print(f"stage accuracy, all cases:              {_ratio((sum(stage_hits), len(cases)))}")
    false_oom = [
        case["id"]
        for case, failure in zip(cases, predicted, strict=True)
        if not FailureKind(case["label"]).is_oom and failure.kind.is_oom
    ]
    print(f"non-OOM cases called OOM:               {len(false_oom)} {false_oom or ''}")
    # Issue 33's verdicts, newer than the corpus's labels: counted as misses above, listed here.
    resumed = [case["id"] for case, f in zip(cases, predicted, strict=True) if f.kind.value == "oom_resume"]
    marked = [case["id"] for case, f in zip(cases, predicted, strict=True) if SPURIOUS_KEY in f.numbers]
    print(f"called oom_resume (no corpus label):     {len(resumed)} {resumed or ''}")
    print(f"marked spurious (retried once):         {len(marked)} {marked or ''}")
    if show_misses:
        print_misses(cases, predicted, stage_hits)


_STAGE_KINDS = frozenset(
    {"oom_load", "oom_forward", "oom_backward", "oom_optimizer", "oom_eval", "oom_merge"}
)


def text_decides_stage(case: Mapping[str, Any]) -> bool:
    """The module docstring's test: a stage-named kind needs at least one real traceback frame."""
    if case["label"] not in _STAGE_KINDS:
        return True
    return any(frame.path or frame.function for frame in parse_frames(case["text"]))


def kinds_stage_ok(label_stage: str, predicted: str) -> bool:
    return predicted in STAGE_MATCH.get(label_stage, frozenset({label_stage}))


def print_confusion(labels: Sequence[str], kinds: Sequence[str]) -> None:
    order = [kind.value for kind in FailureKind if kind.value in set(labels) | set(kinds)]
    pairs = Counter(zip(labels, kinds, strict=True))
    print("confusion (rows: label, columns: predicted)")
    print(f"{'':>18}" + "".join(f"{ABBREV[k]:>7}" for k in order))
    for label in order:
        if label in labels:
            cells = "".join(f"{pairs[(label, k)] or '.':>7}" for k in order)
            print(f"{label:>18}{cells}")


def print_recall(labels: Sequence[str], kinds: Sequence[str]) -> None:
    print("\nper-kind recall")
    for label in sorted(set(labels), key=lambda value: list(FailureKind).index(FailureKind(value))):
        hits = sum(1 for lab, kind in zip(labels, kinds, strict=True) if lab == label and kind == label)
        print(f"  {label:<18} {hits}/{labels.count(label)}")


def print_misses(
    cases: Sequence[dict[str, Any]], predicted: Sequence[Any], stage_hits: Sequence[bool]
) -> None:
    print("\nmisses (id label/stage -> kind/stage: evidence)")
    for case, failure, stage_ok in zip(cases, predicted, stage_hits, strict=True):
        if case["label"] != failure.kind.value or not stage_ok:
            cut = " [cut]" if case.get("final_line_missing") else ""
            print(
                f"  {case['id']}{cut} {case['label']}/{case['stage']} -> "
                f"{failure.kind.value}/{failure.stage.value}: {failure.evidence[:150]}"
            )


def score_formats(cases: Sequence[dict[str, Any]]) -> None:
    per_key: Counter[str] = Counter()
    right: Counter[str] = Counter()
    message_ok = 0
    for case in cases:
        got = _jsonable(parse_numbers(case["text"]))
        for key in set(case["numbers"]) | set(got):
            per_key[key] += 1
            right[key] += case["numbers"].get(key) == got.get(key)
        message_ok += _messages(case["text"]) == [_expected_message(m) for m in case["messages"]]
    score = _ratio((sum(right.values()), sum(per_key.values())))
    print(f"\nformats.jsonl: {len(cases)} cases, number keys exact {score}")
    print("  " + ", ".join(f"{key} {right[key]}/{per_key[key]}" for key in sorted(per_key)))
    print(f"  every message (device, gpu, format, numbers) exact: {message_ok}/{len(cases)}")


def _messages(text: str) -> list[tuple[str, int | None, str, dict[str, Any]]]:
    return [(m.device, m.gpu, m.format, _jsonable(m.numbers)) for m in parse_messages(text)]


def _expected_message(message: Mapping[str, Any]) -> tuple[str, int | None, str, dict[str, Any]]:
    return (message["device"], message["gpu"], message["format"], dict(message["numbers"]))


def _jsonable(numbers: Mapping[str, Any]) -> dict[str, Any]:
    plain: dict[str, Any] = json.loads(json.dumps(dict(numbers)))
    return plain


def _hits(labels: Sequence[str], kinds: Sequence[str], indices: Iterable[int]) -> tuple[int, int]:
    chosen = list(indices)
    return sum(labels[i] == kinds[i] for i in chosen), len(chosen)


def _ratio(pair: tuple[int, int]) -> str:
    hits, total = pair
    return f"{hits}/{total} = {100 * hits / total:.1f} %" if total else "0/0"


def score_fixtures(cases: Sequence[dict[str, Any]]) -> None:
    """The reconstructed cases of tests/fixtures/diagnosis (a JSON list with ``kind``/``stage``)."""
    right = 0
    print(f"\nfixtures: {len(cases)} reconstructed cases (id: expected -> classified)")
    for case in cases:
        found = classify_text(case["text"])
        ok = (found.kind.value, found.stage.value) == (case["kind"], case["stage"])
        right += ok
        mark = " spurious" if SPURIOUS_KEY in found.numbers else ""
        print(f"  {'ok  ' if ok else 'MISS'} {case['id']}: {case['kind']}/{case['stage']} -> "
              f"{found.kind.value}/{found.stage.value}{mark}")  # fmt: skip
    print(f"  {_ratio((right, len(cases)))}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dev", nargs="?", type=Path, default=DEFAULT_DEV)
    parser.add_argument("--formats", type=Path, default=None)
    parser.add_argument("--show-misses", action="store_true")
    parser.add_argument("--fixtures", type=Path, default=None, help="tests/fixtures/diagnosis/*.json")
    args = parser.parse_args(argv)
    formats = args.formats or args.dev.with_name("formats.jsonl")
    if not args.dev.is_file():
        print(f"note: no labelled corpus at {args.dev}; nothing to score")
    else:
        score_dev(load_jsonl(args.dev), args.show_misses)
    if formats.is_file():
        score_formats(load_jsonl(formats))
    if args.fixtures is not None:
        score_fixtures(json.loads(args.fixtures.read_text(encoding="utf-8")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
