"""`qlora-supervise plan`: the safetensors header reader and the text and JSON views."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest

from qlora_supervise.supervisor.commands import cli
from qlora_supervise.supervisor.commands.plan import make_plan, plan_command
from qlora_supervise.supervisor.jobfile import model_files

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A header-only safetensors file (data bytes omitted: the reader never looks at them)."""
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = model_files.TensorInfo(dtype, tuple(shape)).nbytes
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def make_job(tmp_path: Path, config: dict[str, object], extra: str = "") -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    write_safetensors(
        model / "model-00001-of-00002.safetensors",
        {"model.embed_tokens.weight": ("BF16", [128256, 4096])},
    )
    write_safetensors(
        model / "model-00002-of-00002.safetensors", {"lm_head.weight": ("BF16", [128256, 4096])}
    )
    index = {
        "metadata": {"total_size": 16_060_522_496},
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
        },
    }
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    job = tmp_path / "job.yaml"
    job.write_text(
        "model: {path: model}\ndata: {path: data.jsonl}\n"
        "train: {max_seq_len: 4096, micro_batch_size: 4, effective_batch_size: 16,"
        " gradient_checkpointing: false}\n" + extra
    )
    return job


def test_header_reader_reads_names_dtypes_shapes(tmp_path: Path) -> None:
    """The 8-byte length + JSON header gives every tensor's dtype and shape without the data."""
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"a": ("BF16", [3, 4]), "b": ("F32", [5])})
    tensors = model_files.read_header(path)
    assert tensors == {"a": model_files.TensorInfo("BF16", (3, 4)), "b": model_files.TensorInfo("F32", (5,))}
    assert tensors["a"].nbytes == 24 and tensors["b"].nbytes == 20


@pytest.mark.parametrize(
    "content", [b"", b"\x05\x00\x00\x00\x00\x00\x00\x00{", b"\x02\x00\x00\x00\x00\x00\x00\x00[]"]
)
def test_header_reader_refuses_what_is_not_safetensors(tmp_path: Path, content: bytes) -> None:
    """Short, cut or non-object headers are a ModelFilesError naming the file."""
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(model_files.ModelFilesError, match=r"bad\.safetensors"):
        model_files.read_header(path)


def test_index_and_shards_give_size_and_tensors(tmp_path: Path) -> None:
    """A sharded checkpoint: total size from the index, names from each shard's header."""
    make_job(tmp_path, LLAMA3_8B)
    files = model_files.read_model_files(tmp_path / "model")
    assert files.checkpoint_bytes == 16_060_522_496
    assert set(files.tensors) == {"model.embed_tokens.weight", "lm_head.weight"} and files.has_lm_head


def test_plan_json_has_the_schema_and_components_sum(tmp_path: Path) -> None:
    """--json: peak_bytes, components that sum to it, a budget from --gpu-memory and a start config."""
    job = make_job(tmp_path, LLAMA3_8B)
    out = io.StringIO()
    assert plan_command(str(job), gpu_memory="24GiB", as_json=True, out=out) == 0
    plan = json.loads(out.getvalue())
    assert plan["schema"] == "qlora-supervise.plan/1"
    assert plan["peak_bytes"] == sum(plan["components"].values()) > 0
    assert plan["card"]["source"] == "flag" and plan["card"]["budget_bytes"] < 24 << 30
    assert plan["fits_as_written"] is False
    start = plan["start"]
    assert start["fits"] and not start["quality_changed"] and start["knobs"]["max_seq_len"] == 4096
    assert start["peak_bytes"] <= plan["card"]["budget_bytes"] / 1.08
    assert {r["name"] for r in plan["rungs"]} >= {"gradient_checkpointing", "halve_micro_batch"}
    assert plan["host"]["checkpoint_bytes"] == 16_060_522_496 and plan["host"]["load_peak_bytes"] > 16e9


def test_plan_uses_the_job_cap_without_a_reserve(tmp_path: Path) -> None:
    """A gpu_memory_limit is a cap on the allocator: the budget is the cap itself."""
    job = make_job(tmp_path, LLAMA3_8B, "resources: {gpu_memory_limit: 16GiB}\n")
    plan = make_plan(str(job), None)
    assert plan["card"]["source"] == "job_cap" and plan["card"]["budget_bytes"] == 16 << 30


def test_plan_text_shows_components_verdict_start_and_host(tmp_path: Path) -> None:
    """The text view names the components, the verdict, the start config, the rungs and host RAM."""
    job = make_job(tmp_path, LLAMA3_8B)
    out = io.StringIO()
    plan_command(str(job), gpu_memory="24GiB", out=out)
    text = out.getvalue()
    for expected in (
        "weights_4bit",
        "lm_head_fp32",
        "fits as written",
        "NO",
        "start from:",
        "rungs",
        "host RAM",
    ):
        assert expected in text


def test_plan_says_when_a_model_is_not_modelled(tmp_path: Path) -> None:
    """A mixture-of-experts config gets no number, and a reason."""
    job = make_job(tmp_path, {**LLAMA3_8B, "num_local_experts": 8})
    plan = make_plan(str(job), "24GiB")
    assert plan["unsupported"]["reason"] == "mixture_of_experts" and plan["peak_bytes"] is None
    out = io.StringIO()
    plan_command(str(job), gpu_memory="24GiB", out=out)
    assert "NOT MODELLED" in out.getvalue()


def test_bad_gpu_memory_is_a_bad_job_exit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--gpu-memory that is not a size: exit 2 and a message naming the flag."""
    job = make_job(tmp_path, LLAMA3_8B)
    assert cli.main(["plan", str(job), "--gpu-memory", "lots"]) == 2
    assert "--gpu-memory" in capsys.readouterr().err
