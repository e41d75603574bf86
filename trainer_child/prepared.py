"""What a warm spare readies before its attempt exists: the tokenizer, the rows and their lengths.

The CPU half of the recipe's load depends on no knob a rung changes, only on the model (the
tokenizer), the data, the seed (the eval split) and packing (whether lengths are taken). A spare
started behind attempt N prepares them from N's spec while N trains; attempt N+1 takes them
when its own inputs are equal to those, and loads its own otherwise. Both ways run the same
functions on the same inputs, in the same order relative to the seed (none of them draws from
a generator: the split takes its seed explicitly), so preparing ahead cannot change a result.

What it saves is the time between the OOM and the next forward pass: the tokenizer, the data
set, and tokenizing up to ``MAX_REPORTED_LENGTHS`` rows for their lengths, all before the GPU
is free again.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from . import data
from .attempt_facts import SampleLengths
from .protocol import AttemptSpec, DataSpec


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Everything the prepared objects depend on; equal inputs, equal objects."""

    model: str
    trust_remote_code: bool
    data: DataSpec
    seed: int
    packing: bool

    @classmethod
    def of(cls, spec: AttemptSpec) -> Inputs:
        train = spec.train
        return cls(spec.knobs.model, train.trust_remote_code, spec.data, train.seed, train.packing)


@dataclasses.dataclass
class Prepared:
    """The tokenizer, the training and eval rows, and the rows' lengths (None when packing)."""

    inputs: Inputs
    tokenizer: Any
    train_set: Any
    eval_set: Any | None
    lengths: SampleLengths | None
    seconds: float

    def serves(self, spec: AttemptSpec) -> bool:
        return self.inputs == Inputs.of(spec)


def load_rows(spec: AttemptSpec, tokenizer: Any) -> tuple[Any, Any | None, SampleLengths | None]:
    """(train, eval or None, lengths or None): the recipe's data step, prepared or not."""
    train_set, eval_set = data.train_eval_split(spec.data, tokenizer, spec.train.seed)
    # Packed rows are chunked, not cut, at max_seq_len: their lengths say nothing of a loss.
    lengths = None if spec.train.packing else data.sample_lengths(train_set, tokenizer)
    return train_set, eval_set, lengths


def prepare(spec: AttemptSpec) -> Prepared:
    """Load the CPU-side inputs of ``spec``'s recipe (errors are the attempt's to report)."""
    from .recipe import load_tokenizer

    started = time.monotonic()
    tokenizer = load_tokenizer(spec)
    train_set, eval_set, lengths = load_rows(spec, tokenizer)
    return Prepared(
        Inputs.of(spec), tokenizer, train_set, eval_set, lengths, round(time.monotonic() - started, 3)
    )
