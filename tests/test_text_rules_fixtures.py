"""Text rules as careful as the run's (issue 33): layouts, load/backward/optimizer frames, caps.

The table is tests/fixtures/diagnosis/issue33-cases.json: failure outputs reconstructed from public
reports (each case names its report and which facts it kept), one per shape the issue names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from qlora_supervise.supervisor.diagnosis import _oom_rules
from qlora_supervise.supervisor.diagnosis._frames import parse_frames, stage_from_frames
from qlora_supervise.supervisor.diagnosis.classify import classify_text
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage
from qlora_supervise.trainer_child.contract.oom_message import parse_numbers

CASES: list[dict[str, Any]] = json.loads(
    (Path(__file__).with_name("fixtures") / "diagnosis" / "issue33-cases.json").read_text(encoding="utf-8")
)
SITE = "/venv/lib/python3.11/site-packages"
MIB, GIB = 1024**2, 1024**3


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_reconstructed_report_is_classified_by_its_stage(case: dict[str, Any]) -> None:
    """Each reconstructed report gets its shape's kind and stage; only a spurious one is marked so."""
    assert case["source"] and case["kept"]  # every fixture cites the report it was rebuilt from
    found = classify_text(case["text"])
    assert (found.kind.value, found.stage.value) == (case["kind"], case["stage"]), found.evidence
    assert ("spurious_room" in found.numbers) is bool(case.get("spurious")), found.evidence


def test_ipython8_frames_are_read_with_their_qualified_names() -> None:
    """IPython 8's ``File path:N, in Class.method(...)`` lines become frames: path, name, arrow line."""
    text = next(case["text"] for case in CASES if case["id"] == "i33-ipython8-trainer-init")
    frames = parse_frames(text)
    names = [frame.function for frame in frames]
    assert names == [
        "SFTTrainer.__init__",
        "Trainer.__init__",
        "Trainer._move_model_to_device",
        "Module.to",
        "Module._apply",
        "Module.to.<locals>.convert",
    ]
    assert frames[1].path.endswith("transformers/trainer.py")
    assert frames[1].source == "self._move_model_to_device(model, args.device)"


def test_a_rich_function_name_wrapped_onto_the_next_line_is_read() -> None:
    """A rich box that pushes the function onto its next line still yields that function's frame."""
    text = (
        "│ /home/u/venvs/train/lib/python3.10/site-packages/transformers/trainer.py:1809 in  │\n"
        "│ _inner_training_loop                                                      │\n"
        "│ /home/u/venvs/train/lib/python3.10/site-packages/transformers/trainer.py:2690 in  │\n"
        "│ _load_optimizer_and_scheduler                                             │\n"
    )
    assert [frame.function for frame in parse_frames(text)] == [
        "_inner_training_loop",
        "_load_optimizer_and_scheduler",
    ]
    assert stage_from_frames(parse_frames(text), text).stage is Stage.RESUME


def _frames(*frames: tuple[str, str, str]) -> str:
    body = "".join(f'  File "{p}", line {n}, in {f}\n    {s}\n' for n, (p, f, s) in enumerate(frames, 10))
    return f"Traceback (most recent call last):\n{body}"


def test_a_trainer_init_is_load_even_without_the_placement_frames() -> None:
    """An OOM whose deepest named frame is a Trainer's __init__ is load, not the forward fallback."""
    text = _frames(
        ("/work/train.py", "main", "trainer = CustomTrainer(model=model, args=args)"),
        (f"{SITE}/llamafactory/train/sft/trainer.py", "__init__", "super().__init__(**kwargs)"),
    )
    assert stage_from_frames(parse_frames(text), text).stage is Stage.LOAD


def test_a_step_named_in_a_user_folder_called_adam_is_not_an_optimizer() -> None:
    """Optimizer packages are recognised by their file names, not by any folder (a user named adam)."""
    text = _frames(("/home/adam/project/loop.py", "step", "out = model(batch)"))
    assert stage_from_frames(parse_frames(text), text).stage is not Stage.OPTIMIZER
    text = _frames((f"{SITE}/lion_pytorch/lion_pytorch.py", "step", "update_fn(p, grad, exp_avg)"))
    assert stage_from_frames(parse_frames(text), text).stage is Stage.OPTIMIZER


def test_a_model_load_state_dict_outside_a_resume_stays_load() -> None:
    """A model's load_state_dict at start-up is load; an optimizer's state loaded back is resume."""
    model = _frames(
        ("/work/train.py", "main", "model.load_state_dict(torch.load(path))"),
        (f"{SITE}/torch/nn/modules/module.py", "load_state_dict", "load(self, state_dict)"),
    )
    assert stage_from_frames(parse_frames(model), model).stage is Stage.LOAD
    optimizer = _frames(
        ("/work/train.py", "main", "opt.load_state_dict(torch.load(path))"),
        (f"{SITE}/torch/optim/optimizer.py", "load_state_dict", "state_dict = deepcopy(sd)"),
    )
    assert stage_from_frames(parse_frames(optimizer), optimizer).stage is Stage.RESUME
    assert (
        classify_text(optimizer + "torch.OutOfMemoryError: CUDA out of memory.").kind
        is FailureKind.OOM_RESUME
    )


CAPPED = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried}. GPU 0 has a total capacity of "
    "139.80 GiB of which 125.00 GiB is free. Including non-PyTorch memory, this process has 8.05 GiB memory "
    "in use. 8.00 GiB allowed; Of the allocated memory {allocated} is allocated by PyTorch, and {split} is "
    "reserved by PyTorch but unallocated."
)


@pytest.mark.parametrize(
    ("tried", "allocated", "split", "fragmentation"),
    [
        ("700.00 MiB", "6.80 GiB", "600.00 MiB", False),  # split + room cover it, the split alone does not
        ("344.00 MiB", "6.95 GiB", "950.00 MiB", True),  # the split memory alone holds the request
        ("172.00 MiB", "7.77 GiB", "182.28 MiB", False),  # H200 8 GiB cap: under the size floor
    ],
)
def test_a_capped_oom_is_fragmentation_only_when_the_split_memory_holds_the_request(
    tried: str, allocated: str, split: str, fragmentation: bool
) -> None:
    """Under a cap the request must fit in one piece of the reserved-but-unallocated memory."""
    numbers = _oom_rules.derive(parse_numbers(CAPPED.format(tried=tried, allocated=allocated, split=split)))
    assert (_oom_rules.fragmentation(numbers) is not None) is fragmentation


def test_the_one_piece_rule_is_for_capped_processes_only() -> None:
    """Without a cap, split memory plus the device's free memory covering the request stays fragmentation."""
    uncapped = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity "
        "of 23.65 GiB of which 600.00 MiB is free. Including non-PyTorch memory, this process has 23.05 GiB "
        "memory in use. Of the allocated memory 20.80 GiB is allocated by PyTorch, and 1.20 GiB is reserved "
        "by PyTorch but unallocated."
    )
    assert classify_text(uncapped).kind is FailureKind.OOM_FRAGMENTATION
