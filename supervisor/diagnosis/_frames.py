"""Where a traceback was: frames out of any traceback layout, and the stage they name.
Layouts: CPython (``File "p", line N, in f`` + source, with ``[rankN]:`` or log prefixes, lost
indentation, hard wrapping), IPython 7 / 8 (``--> N source``) and rich (``│ p:N in f │``). A qualified
name matches by its last part, and by its class where that says more (``SFTTrainer.__init__``). A text
with no frame at all has its bare code lines stand in for frames. The stage rule (:func:`stage_from_frames`):
0. our trainer child's failure line (``trainer child failed in <stage>:``) wins over any frame;
1. contexts win over any frame inside them: merge (any merge/export frame), else eval (unless a
   training step is deeper: GRPO rollouts inside a step stay eval), else resume (loading a
   checkpoint's optimizer / scheduler / state);
2. otherwise the *deepest* frame naming optimizer, backward, forward, load or setup decides (an outer
   frame only says who called), except a forward inside backward (checkpoint recomputation: backward);
   an optimizer step inside backward stays optimizer (layer-wise ``optimizer_hook``);
3. autograd's markers say backward where the frames say forward or nothing;
4. bare tensor operations say forward only when nothing else names a stage; then log lines: an
   unfinished ``Loading checkpoint shards`` bar says load, process-group initialisation setup.
Within one frame a merge/export script's file name comes first, then the source line (the call in
progress), then the function name; stages are tried in :data:`_FUNCTION_RULES`' order."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from qlora_supervise.trainer_child.contract.codes import Stage
from qlora_supervise.trainer_child.contract.report import FAILURE_LINE_PREFIX


@dataclasses.dataclass(frozen=True)
class Frame:
    """One traceback frame as printed; any part may be empty."""

    path: str
    function: str
    source: str


@dataclasses.dataclass(frozen=True)
class StageFinding:
    """The stage and what named it (a frame, a log line, or nothing)."""

    stage: Stage
    why: str


_PY_FRAME = re.compile(r'File\s*"(?P<path>[^"]+)",\s*line\s+\d+,\s*in\s+(?P<func>[^\s│]+)')
_IPY_FRAME = re.compile(
    r"^\s*(?:File\s+(?P<path8>[^\s\"][^\n]*?):\d+, in (?P<func8>[\w<>.]+)\(.*\)"  # IPython 8
    r"|(?P<path>\S+?) in (?P<func>[\w<>.: ]+?)\(.*\))\s*$",  # IPython 7
    re.MULTILINE,
)
_IPY_SOURCE = re.compile(r"^\s*-+>\s*\d+\s+(?P<src>.+)$", re.MULTILINE)
# rich wraps a long path's function name onto the box's next line
_RICH_FRAME = re.compile(r"│\s*(?P<path>\S+):\d+ in(?: |\s*│\s*\n\s*│\s*)(?P<func>[\w<>.]+)\s*│")
_RICH_SOURCE = re.compile(r"❱\s*\d+\s*(?:│\s*)*(?P<src>.*?)\s*│?\s*$", re.MULTILINE)
_LINE_PREFIX = re.compile(r"^\s*(?:\[rank\d+\]:|\d+:|SUBPROCESS:)\s?")
_ARROW = re.compile(r"^\s*-+>\s*\d+\s+")
_CODE_LINE = re.compile(r"^\s*(?:return\s+|\w+\s*=\s*)?[\w.]+(?:\[[^\]]*\])?\(.*\)\s*$")
_OUR_CHILD = re.compile(re.escape(FAILURE_LINE_PREFIX) + "(" + "|".join(Stage) + "):")  # the stages' values
_MERGE_LOG = re.compile(
    r"\bmerge_device_map\b|\bmerge_and_unload\b|\bmerging\b[^\n]{0,40}\b(?:lora|adapter|weights|model)\b",
    re.IGNORECASE,
)
_SHARDS = re.compile(r"Loading checkpoint shards:.*?(\d+)/(\d+)")
_AUTOGRAD_MARKERS = re.compile(
    r"Traceback of forward call that caused the error|Error detected in \w+Backward\d*\b"
    r"|torch::autograd::Engine::|autograd::engine::evaluate_function"
)
# A training step: an eval frame outside one of these does not make what runs inside it eval.
_TRAINING_STEP = re.compile(r"(?:training_step|_inner_training_loop|train_step)$")
# Optimizer packages whose file names do not say "optim" (their step is the optimizer's).
_OPTIMIZER_PACKAGES = (
    r"(?i)\w*(?:galore|apollo|fira|adam|lion|lomo|sophia|adafactor|muon|soap|shampoo)\w*\.py$"
)
# (stage, pattern on the function name, pattern the path must match or None)
_FUNCTION_RULES: tuple[tuple[Stage, str, str | None], ...] = (
    (Stage.MERGE, r"(?:\w*_)?merged?(?:_\w*)?|save_pretrained_gguf|push_to_hub_gguf", None),
    (Stage.EVAL, r"_?evaluat\w*|_?predict(?:ion)?(?:_\w+)?|eval_\w+|_?generate", None),
    (Stage.EVAL, r"nested_concat|pad_across_processes|validation_step|validation_loop|test_step", None),
    (Stage.EVAL, r"_?sample|greedy_search|_?beam_search|contrastive_search|assisted_decoding", r"generat"),
    # Loading a resume checkpoint's state (a context, rule 1).
    (Stage.RESUME, r"_load_optimizer_and_scheduler|_load_from_checkpoint|_load_scaler|_load_rng_state", None),
    (Stage.RESUME, r"load_accelerator_state|load_state", r"accelerate[/\\]"),
    (Stage.RESUME, r"_?load_checkpoint|_load_zero_checkpoint|_load_optimizer_state", r"deepspeed[/\\]"),
    (Stage.RESUME, r"load_state_dict|_process_value_according_to_param_policy|_cast", r"optim"),
    (Stage.OPTIMIZER, r"\w*optimizer_step|_maybe_opt_step|_init_group|initialize_optimizer_states", None),
    (Stage.OPTIMIZER, r"optimizer_hook", None),  # layer-wise optimizers step inside backward
    # Low-rank projection optimizers (GaLore, APOLLO, Fira) take an SVD of the gradient in step.
    (Stage.OPTIMIZER, r"step|project(?:_back)?|get_orthogonal_matrix", _OPTIMIZER_PACKAGES),
    (Stage.OPTIMIZER, r"_configure_(?:zero_)?optimizer|_(?:multi|single)_tensor_\w+|_fused_adamw?", None),
    (Stage.OPTIMIZER, r"\w+", r"(?:^|[/\\])(?:optim|optimizers?|sharded_optim)[/\\]|grad_scaler\.py"),
    (Stage.OPTIMIZER, r"step", r"optim|scaler|[/\\]zero[/\\]"),
    (Stage.BACKWARD, r"backward|_?engine_run_backward|run_backward|_make_grads|tracked_backward", None),
    (Stage.BACKWARD, r"unpack_hook|recompute_fn", r"checkpoint"),
    (Stage.FORWARD, r"forward|\w+_forward|_?(?:wrapped_)?call_impl|\w*compute_loss\w*", None),
    (Stage.FORWARD, r"\w*cross_entropy\w*|ForCausalLMLoss|\w*attention\w*|\w*_attn\w*|mlp", None),
    (Stage.FORWARD, r"scaled_dot_product_attention|matmul_4bit|dequantize_4bit|lm_head", None),
    (Stage.LOAD, r"from_pretrained|_load_pretrained_model|_?load_state_dict\w*|load_model", None),
    (Stage.LOAD, r"load_checkpoint_and_dispatch|dispatch_model|caching_allocator_warmup", None),
    (Stage.LOAD, r"\w*(?:tensor|weigh\w*|param\w*|module|model)_to_device|quantize_4bit", None),
    (Stage.LOAD, r"prepare_model_for_kbit_training|prepare_model", None),
    (Stage.LOAD, r"__init__", r"(?i)trainer\w*\.py$|[/\\]trainers?[/\\]"),
    (Stage.LOAD, r"_apply|convert|to|cuda", r"torch[/\\]nn[/\\]modules[/\\]module\.py"),
    (Stage.SETUP, r"init_process_group|_verify_model_across_ranks", None),
    (Stage.SETUP, r"<module>", r"site-packages|dist-packages"),
)
# Merge / export scripts are recognised by file name as well.
_MERGE_FILE = re.compile(r"(?:^|[/\\_])(?:merge|export)\w*\.py$", re.IGNORECASE)
_SOURCE_RULES: tuple[tuple[Stage, str], ...] = (
    (Stage.MERGE, r"merge_and_unload\(|save_pretrained_merged\(|push_to_hub_merged\(|_gguf\("),
    (Stage.EVAL, r"\.(?:evaluate\w*|generate|predict)\(|\bgenerate\("),
    (Stage.RESUME, r"\b\w*(?:optimizer|optim|scheduler|scaler)\w*\.load_state_dict\("),
    (Stage.OPTIMIZER, r"\b\w*(?:optimizer|optim|scaler)\w*\.step\(|optimizer_step\("),
    (Stage.OPTIMIZER, r"_configure_zero_optimizer\(|DeepSpeedZeroOptimizer\w*\("),
    (Stage.BACKWARD, r"\.backward\(|autograd\.grad\(|run_backward\("),
    (Stage.FORWARD, r"\blora_[AB]\b|self\.(?:mlp|self_attn|attn|lm_head)\b|attention|_attn\b"),
    (Stage.FORWARD, r"cross_entropy|loss_function\(|compute_loss\(|dequantize_4bit|matmul_4bit"),
    (Stage.FORWARD, r"\bforward_call\(|\bself\.model\("),
    (Stage.LOAD, r"\.from_pretrained\(|prepare_model_for_kbit_training\(|caching_allocator_warmup\("),
    (Stage.LOAD, r"\b(?:model|module)\.(?:to|cuda)\(|\.weight\.data\.to\("),
    (Stage.SETUP, r"DistributedDataParallel\(|init_process_group\("),
)
# Tensor operations: forward only when nothing else names a stage.
_WEAK_FORWARD = re.compile(r"\b(?:matmul|bmm|einsum|softmax|linear|baddbmm)\b|\b(?:key|query)_states\b")
_COMPILED_FUNCTIONS = tuple(
    (stage, re.compile(rf"(?:{name})$"), re.compile(path) if path else None)
    for stage, name, path in _FUNCTION_RULES
)
_COMPILED_SOURCES = tuple((stage, re.compile(pattern)) for stage, pattern in _SOURCE_RULES)
_CONTEXT_STAGES = (Stage.MERGE, Stage.EVAL, Stage.RESUME)
# A qualified name as IPython 8 prints it (Trainer._move_model_to_device, Module.to.<locals>.convert).
_QUALIFIED_RULES: tuple[tuple[Stage, re.Pattern[str]], ...] = (
    (Stage.LOAD, re.compile(r"\w*Trainer\.__init__$")),
    (Stage.OPTIMIZER, re.compile(r"\w*(?:Optimizer|Optim|Adam\w*|Lion|SGD|Adafactor)\w*\.step$")),
)


def parse_frames(text: str) -> list[Frame]:
    """The frames of every traceback in ``text``, outermost first as printed."""
    boxes = [(m.start(), Frame(m.group("path"), m.group("func"), "")) for m in _RICH_FRAME.finditer(text)]
    rich = boxes + [(m.start(), Frame("", "", m.group("src"))) for m in _RICH_SOURCE.finditer(text)]
    python = [  # a hard-wrapped path is joined
        (m.start(), Frame("".join(m.group("path").split()), m.group("func"), _next_source_line(text, m)))
        for m in _PY_FRAME.finditer(text)
    ]
    frames = [frame for _, frame in sorted(python + _ipython_frames(text) + rich, key=lambda item: item[0])]
    return frames or _bare_code_lines(text)


def stage_from_frames(frames: Sequence[Frame], text: str = "") -> StageFinding:
    """The stage the frames name (module docstring), or UNKNOWN."""
    ours = _OUR_CHILD.findall(text)
    if ours:  # our trainer child names its stage in its last line (contract.report.failure_line)
        return StageFinding(Stage(ours[-1]), "the trainer child's failure line")
    named = [(frame, frame_stage(frame)) for frame in frames]
    if (context := _context_stage(named)) is not None:
        return context
    finding: StageFinding | None = None
    for frame, stage in named:  # outermost first: a deeper frame replaces an outer one
        recomputed = stage is Stage.FORWARD and finding is not None and finding.stage is Stage.BACKWARD
        if stage is not None and not recomputed:  # a forward inside backward: checkpoint recomputation
            finding = StageFinding(stage, f"frame {_describe(frame)}")
    marker = _AUTOGRAD_MARKERS.search(text)
    if marker and (finding is None or finding.stage is Stage.FORWARD):
        return StageFinding(Stage.BACKWARD, f"autograd marker {marker.group(0)!r}")
    weak = next((frame.source for frame in reversed(frames) if _WEAK_FORWARD.search(frame.source)), None)
    if finding is None and weak is not None:
        return StageFinding(Stage.FORWARD, f"tensor operation {weak.strip()[:60]!r}")
    return finding or _log_hint(text)


def frame_stage(frame: Frame) -> Stage | None:
    """The stage one frame names: a merge script's file, its source line, then its function."""
    if _MERGE_FILE.search(frame.path):
        return Stage.MERGE
    for stage, pattern in _COMPILED_SOURCES:
        if pattern.search(frame.source):
            return stage
    for stage, qualified in _QUALIFIED_RULES:
        if qualified.match(frame.function):
            return stage
    function = frame.function.rsplit(".", 1)[-1]  # Module.to.<locals>.convert -> convert
    for stage, name, path in _COMPILED_FUNCTIONS:
        if name.match(function) and (path is None or path.search(frame.path)):
            return stage
    return None


def _context_stage(named: Sequence[tuple[Frame, Stage | None]]) -> StageFinding | None:
    """Merge anywhere; else the outermost eval frame with no training step deeper than it."""
    for context in _CONTEXT_STAGES:
        for index, (frame, stage) in enumerate(named):
            if stage is not context:  # first: the scan of the deeper frames below is for a match only
                continue
            if context is Stage.EVAL and any(_TRAINING_STEP.match(f.function) for f, _ in named[index + 1 :]):
                continue
            return StageFinding(stage, f"frame {_describe(frame)}")
    return None


def _log_hint(text: str) -> StageFinding:
    if "doesn't have NCCL built in" in text or "init_process_group" in text:
        return StageFinding(Stage.SETUP, "process-group initialisation")
    # A merge/export run says so in its log before it loads the base model.
    if merge := _MERGE_LOG.search(text):
        return StageFinding(Stage.MERGE, f"a log line names a merge ({merge.group(0)!r})")
    if (shards := _SHARDS.findall(text)) and int(shards[-1][0]) < int(shards[-1][1]):
        return StageFinding(Stage.LOAD, "an unfinished 'Loading checkpoint shards' progress bar")
    return StageFinding(Stage.UNKNOWN, "no frame names a stage")


def _describe(frame: Frame) -> str:
    where = frame.path.replace("\\", "/").rsplit("/", 1)[-1]
    name = f"{frame.function} ({where})" if frame.function else "code line"
    source = frame.source.strip()
    return f"{name}: {source[:60]}" if source else name


def _next_source_line(text: str, match: re.Match[str]) -> str:
    prefix = text[text.rfind("\n", 0, match.start()) + 1 : match.start()]
    rest = text[match.end() :].split("\n", 2)
    if len(rest) < 2:
        return ""
    line = rest[1]
    if prefix.strip() and line.startswith(prefix.rstrip()):
        line = line[len(prefix.rstrip()) :]
    line = _LINE_PREFIX.sub("", line).strip()
    return "" if "File " in line or set(line) <= set("^~ ") else line


def _ipython_frames(text: str) -> list[tuple[int, Frame]]:
    frames = []
    for match in _IPY_FRAME.finditer(text):
        source = _IPY_SOURCE.search(text, match.end())
        src = source.group("src") if source else ""
        if source is not None and _IPY_FRAME.search(text, match.end(), source.start()):
            src = ""  # that arrow belongs to a later frame
        path, func = match.group("path8", "func8") if match.group("path8") else match.group("path", "func")
        frames.append((match.start(), Frame(path, func.strip(), src)))
    return frames


def _bare_code_lines(text: str) -> list[Frame]:
    lines = (_ARROW.sub("", _LINE_PREFIX.sub("", raw)) for raw in text.splitlines())
    return [
        Frame("", "", line.strip())
        for line in lines
        if _CODE_LINE.match(line) and not re.match(r"^\s*\w+(?:\.\w+)*(?:Error|Exception)\b", line)
    ]
