"""What a warm spare readies before its attempt exists: the tokenizer, the rows and their lengths.

They depend on no knob a rung changes. A spare prepares them from attempt N's spec; N+1 takes them when
its inputs are equal, else loads its own, by the same functions: preparing ahead cannot change a result."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from qlora_supervise.trainer_child.contract.attempt_facts import SampleLengths
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DataSpec
from qlora_supervise.trainer_child.recipe import data

#: Files of a model directory the tokenizer never reads: a change to them spoils nothing prepared.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
Stamp = tuple[tuple[str, int, int], ...]


def stamp(path: str | None) -> Stamp:
    """(name, size, mtime_ns) of the file at ``path``, or of a directory's top-level non-weight files."""
    if path is None:
        return ()
    where = Path(path)
    try:
        if where.is_file():
            status = where.stat()
            return ((where.name, status.st_size, status.st_mtime_ns),)
        if where.is_dir():
            files = [f for f in where.iterdir() if f.is_file() and f.suffix not in WEIGHT_SUFFIXES]
            stats = {f.name: f.stat() for f in files}
            return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats.items()))
    except OSError:  # gone or unreadable: the attempt's own load will say so
        return ()
    return ()  # a hub id, not a local path


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Everything the prepared objects depend on, files stamped (rewritten since the spare read them?)."""

    model: str
    trust_remote_code: bool
    data: DataSpec
    seed: int
    packing: bool
    files: tuple[Stamp, Stamp, Stamp] = ((), (), ())  # model directory, data, eval data

    @classmethod
    def of(cls, spec: AttemptSpec) -> Inputs:
        train, data_spec = spec.train, spec.data
        files = (stamp(spec.knobs.model), stamp(data_spec.path), stamp(data_spec.eval_path))
        return cls(spec.knobs.model, train.trust_remote_code, data_spec, train.seed, train.packing, files)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The tokenizer, training and eval rows, and the rows' lengths (None when packing)."""

    inputs: Inputs
    tokenizer: Any
    train_set: Any
    eval_set: Any | None
    lengths: SampleLengths | None
    seconds: float

    def serves(self, spec: AttemptSpec) -> bool:
        return self.inputs == Inputs.of(spec)


def load_rows(spec: AttemptSpec, tokenizer: Any) -> tuple[Any, Any | None, SampleLengths | None]:
    train_set, eval_set = data.train_eval_split(spec.data, tokenizer, spec.train.seed)
    # Packed rows are chunked, not cut, at max_seq_len: their lengths say nothing.
    lengths = None if spec.train.packing else data.sample_lengths(train_set, tokenizer)
    return train_set, eval_set, lengths


def load_tokenizer(spec: AttemptSpec) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        spec.knobs.model, trust_remote_code=spec.train.trust_remote_code
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # the usual fix for Llama-style tokenizers
    return tokenizer


def prepare(spec: AttemptSpec) -> Prepared:
    started = time.monotonic()
    inputs = Inputs.of(spec)  # stamped before reading: a file rewritten meanwhile no longer matches
    tokenizer = load_tokenizer(spec)
    train_set, eval_set, lengths = load_rows(spec, tokenizer)
    return Prepared(inputs, tokenizer, train_set, eval_set, lengths, round(time.monotonic() - started, 3))
