"""Stage from the whole traceback: our child's own line, autograd markers, eval against training_step."""

from __future__ import annotations

from qlora_supervise.supervisor.diagnosis._frames import parse_frames, stage_from_frames
from qlora_supervise.supervisor.diagnosis.classify import classify_text
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage
from qlora_supervise.trainer_child.contract.report import failure_line

SITE = "/venv/lib/python3.11/site-packages"
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."


def _traceback(*frames: tuple[str, str, str]) -> str:
    body = "".join(
        f'  File "{path}", line {n}, in {func}\n    {src}\n' for n, (path, func, src) in enumerate(frames, 10)
    )
    return f"Traceback (most recent call last):\n{body}"


def _stage(text: str) -> Stage:
    return stage_from_frames(parse_frames(text), text).stage


TRAIN = ("/work/train.py", "main", "trainer.train()")
LOOP = (
    f"{SITE}/transformers/trainer.py",
    "_inner_training_loop",
    "tr_loss_step = self.training_step(model, inputs)",
)
STEP = (f"{SITE}/transformers/trainer.py", "training_step", "inputs = self._prepare_inputs(inputs)")
GENERATE = (
    f"{SITE}/trl/trainer/grpo_trainer.py",
    "_generate_and_score_completions",
    "out = unwrapped.generate(ids)",
)
FORWARD = (f"{SITE}/transformers/models/llama/modeling_llama.py", "forward", "attn = self.self_attn(hidden)")


def test_anomaly_mode_forward_traceback_is_a_backward_failure() -> None:
    """detect_anomaly prints the forward call of the op whose backward failed: the stage is backward."""
    warning = (
        "UserWarning: Error detected in MmBackward0. Traceback of forward call that caused the error:\n"
        + _traceback(TRAIN, FORWARD).replace("Traceback (most recent call last):\n", "")
    )
    text = (
        warning
        + _traceback(TRAIN, (f"{SITE}/torch/_tensor.py", "backward", "torch.autograd.backward(self)"))
        + OOM
    )
    assert classify_text(text).kind is FailureKind.OOM_BACKWARD
    assert _stage(warning + OOM) is Stage.BACKWARD  # the forward frames alone would say forward


def test_cpp_autograd_engine_frames_say_backward() -> None:
    """A C++ stack naming torch::autograd::Engine marks a failed backward even without Python frames."""
    text = OOM + "\nException raised from malloc at c10/cuda/CUDACachingAllocator.cpp:1000\n" \
        "frame #7: torch::autograd::Engine::evaluate_function(...) + 0x3b\n"  # fmt: skip
    assert _stage(text) is Stage.BACKWARD


def test_our_childs_failure_line_wins_over_its_frames() -> None:
    """Our child names its stage; frames in its log (an optimizer frame here) do not overrule it."""
    text = _traceback(
        TRAIN, (f"{SITE}/torch/optim/adamw.py", "_multi_tensor_adamw", "torch._foreach_sqrt(s)")
    )
    text += OOM + "\n" + failure_line("backward", "OutOfMemoryError", "CUDA out of memory.") + "\n"
    assert _stage(text) is Stage.BACKWARD


def test_generation_inside_a_training_step_is_eval_but_training_inside_an_eval_name_is_not() -> None:
    """A GRPO rollout inside training_step is eval; a training_step deeper than an eval frame trains."""
    assert _stage(_traceback(TRAIN, LOOP, STEP, GENERATE, FORWARD) + OOM) is Stage.EVAL
    outer_eval = ("/work/run.py", "evaluate_and_train", "trainer.train()")
    compute = (f"{SITE}/transformers/trainer.py", "training_step", "loss = self.compute_loss(model, inputs)")
    assert _stage(_traceback(outer_eval, LOOP, compute, FORWARD) + OOM) is Stage.FORWARD
    evaluate = (f"{SITE}/transformers/trainer.py", "evaluate", "output = eval_loop(dataloader)")
    assert _stage(_traceback(TRAIN, LOOP, evaluate, FORWARD) + OOM) is Stage.EVAL
