"""Training rows from a local jsonl/json/parquet/csv file or a saved ``datasets`` directory: one ``text``
or ``messages`` column. Every problem the job can fix is a ConfigError naming the bad record; the full
scan runs only when loading failed or the column looks wrong, so a good dataset is read once.
What a warm spare readies before its attempt exists (:class:`Prepared`): the tokenizer, the rows and
their lengths, which depend on no knob a rung changes. Attempt N+1 takes what a spare prepared from N's
spec if its inputs are equal, else loads its own by the same functions: preparing ahead changes no result."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

from qlora_supervise.trainer_child.contract.attempt_facts import MAX_REPORTED_LENGTHS, SampleLengths
from qlora_supervise.trainer_child.contract.data_rows import DataRowError, scan
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DataSpec
from qlora_supervise.trainer_child.run.failure import ConfigError

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
#: The column names trl reads: ``text`` for language modelling, ``messages`` for chat.
TEXT = "text"
MESSAGES = "messages"


def load_table(path: str, spec: DataSpec) -> Any:  # -> datasets.Dataset
    """One split from a file or a ``save_to_disk`` directory (a DatasetDict gives its 'train')."""
    import datasets

    source = Path(path)
    if source.is_dir():
        loaded = datasets.load_from_disk(str(source))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ConfigError(f"data {path}: saved DatasetDict has no 'train' split ({list(loaded)})")
            loaded = loaded["train"]
        return loaded
    if not source.is_file():
        raise ConfigError(f"data {path}: no such file or directory")
    if (builder := _BUILDERS.get(source.suffix.lower())) is None:
        raise ConfigError(
            f"data {path}: unknown format {source.suffix!r}, expected one of {sorted(_BUILDERS)}"
        )
    try:
        return datasets.load_dataset(builder, data_files=str(source), split="train")
    except Exception as exc:  # datasets/pyarrow wrap a broken record in their own error kinds
        raise ConfigError(f"data {path}: {_bad_record(source, spec) or f'cannot be read: {exc}'}") from exc


def _bad_record(source: Path, spec: DataSpec) -> str | None:
    if not source.is_file():
        return None
    try:
        scan(source, spec.messages_field or spec.text_field or TEXT, messages=spec.messages_field is not None)
    except DataRowError as error:
        return str(error)
    except (OSError, ValueError, ImportError):
        pass
    return None


def to_rows(table: Any, spec: DataSpec, tokenizer: Any, path: str) -> Any:
    """A dataset of one column: ``text``, or ``messages`` (left as turns, for trl to mask the user's)."""
    if (field := spec.messages_field or spec.text_field) is None:
        raise ConfigError("data: neither text_field nor messages_field is set")
    if field not in table.column_names:
        raise ConfigError(f"data {path}: field {field!r} not found; columns are {table.column_names}")
    if len(table) == 0:
        raise ConfigError(f"data {path}: no rows")
    # Nulls or a non-text column (read cheaply from the arrow table): the bad record, else the column's type.
    column = table.data.column(field)
    kind, wanted = str(column.type), "list" if spec.messages_field else "string"
    if column.null_count or not kind.startswith(("large_" + wanted, wanted)):
        where = _bad_record(Path(path), spec)
        raise ConfigError(
            f"data {path}: {where or f'field {field!r} is {kind} with {column.null_count} null(s)'}"
        )
    # Only the one column: trl would treat a leftover ``messages`` column as a chat dataset.
    rows = table.select_columns([field])
    if spec.messages_field:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError(f"messages_field {field!r} set but the tokenizer has no chat template")
        return rows if field == MESSAGES else rows.rename_column(field, MESSAGES)
    return rows if field == TEXT else rows.rename_column(field, TEXT)


def train_eval_split(spec: DataSpec, tokenizer: Any, seed: int) -> tuple[Any, Any | None]:
    """(train, eval or None) from ``eval_path`` or an ``eval_fraction`` of the training file."""
    train = to_rows(load_table(spec.path, spec), spec, tokenizer, spec.path)
    if spec.eval_path:
        return train, to_rows(load_table(spec.eval_path, spec), spec, tokenizer, spec.eval_path)
    if spec.eval_fraction > 0:
        split = train.train_test_split(test_size=spec.eval_fraction, seed=seed)
        return split["train"], split["test"]
    return train, None


def sample_lengths(rows: Any, tokenizer: Any, limit: int = MAX_REPORTED_LENGTHS) -> SampleLengths:
    """Up to ``limit`` spaced rows' lengths as trl tokenizes them, uncut: what a lower max_seq_len cuts."""
    total = len(rows)
    picked = rows.select(range(0, total, max(1, math.ceil(total / limit))))
    if MESSAGES in picked.column_names:
        chats = [tokenizer.apply_chat_template(c, tokenize=True, return_dict=True) for c in picked[MESSAGES]]
        lengths = [len(chat["input_ids"]) for chat in chats]
    else:
        eos = tokenizer.eos_token or ""
        texts = [text if text.endswith(eos) else text + eos for text in picked[TEXT]]
        lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    return SampleLengths(total, tuple(sorted(lengths)))


#: Files of a model directory the tokenizer never reads: a change to them spoils nothing prepared.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
Stamp = tuple[tuple[str, int, int], ...]


def stamp(path: str | None) -> Stamp:
    """(name, size, mtime_ns) of the file at ``path``, or of a directory's top-level non-weight files."""
    if path is None:
        return ()
    where = Path(path)
    try:
        if where.is_dir():
            files = [f for f in where.iterdir() if f.is_file() and f.suffix not in WEIGHT_SUFFIXES]
        else:
            files = [where] if where.is_file() else []  # else a hub id, not a local path
        stats = {f.name: f.stat() for f in files}
    except OSError:  # gone or unreadable: the attempt's own load will say so
        return ()
    return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats.items()))


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
    train_set, eval_set = train_eval_split(spec.data, tokenizer, spec.train.seed)
    # Packed rows are chunked, not cut, at max_seq_len: their lengths say nothing.
    lengths = None if spec.train.packing else sample_lengths(train_set, tokenizer)
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
