"""The benchmark's scenarios: an over-ambitious job on an emulated card, one or more per card size.

A scenario is what a user would write for a card they do not know the limits of: seq 2048,
micro-batch 4 × accumulation 4, no gradient checkpointing, 32-bit AdamW (``adamw_torch``), r 16 on
q/k/v/o. ``long_row_step`` makes the OOM come mid-run: every row is short except one, placed so
that it lands in that optimizer step (:mod:`.assets`), so the first steps fit and that one does not.

The tiny scenarios run the same logic on the CPU (``--tiny``): the card is ``cpu_memory_limit``
(RLIMIT_DATA) there, and the shapes are memory_grid's CPU stand-ins of the same structure.
"""

from __future__ import annotations

import dataclasses

#: ``card`` of a scenario run with the whole device (the overhead runs): no memory limit at all.
UNCAPPED = "none"


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One job on one card. ``card`` is the job's ``gpu_memory_limit`` (``cpu_memory_limit`` in tiny)."""

    name: str
    card: str
    shape: str  # a key of memory_grid.SHAPES (TINY_SHAPES in tiny mode)
    seq: int = 2048
    micro: int = 4
    accum: int = 4
    long_row_step: int | None = None  # the optimizer step the one long row lands in
    gradient_checkpointing: bool = False
    optimizer: str = "adamw_torch"
    r: int = 16
    max_steps: int = 3
    save_steps: int = 1  # every step: an OOM loses none (the overhead runs save at the end only)

    @property
    def effective_batch(self) -> int:
        return self.micro * self.accum

    @property
    def data_name(self) -> str:
        """The dataset file under the shape's asset directory."""
        return f"data-long-at-{self.long_row_step}.jsonl" if self.long_row_step else "data.jsonl"

    def written(self) -> str:
        """The config as the user wrote it, in the table's words."""
        gc = "ckpt" if self.gradient_checkpointing else "no ckpt"
        return f"s{self.seq} {self.micro}x{self.accum} {gc} {self.optimizer} r{self.r}"


#: One per card (a card command runs its scenarios one after another): the 7B shape on the 8 and
#: 24 GiB cards (24 GiB: the OOM mid-run, from one long sample), the 8B shape on 16 and 32 GiB.
SCENARIOS = (
    Scenario("7b-8GiB", "8GiB", "7b-32k"),
    Scenario("8b-16GiB", "16GiB", "8b-128k"),
    Scenario("7b-24GiB-long-row", "24GiB", "7b-32k", max_steps=6, long_row_step=4),
    Scenario("8b-32GiB", "32GiB", "8b-128k"),
)
#: CPU stand-ins (seq 1024, micro 4 x 2): peak data segments of the trainer child measured on the
#: tiny 7B stand-in are 1176 MiB as written, 1112 MiB with checkpointing, 870 MiB at micro 2, and
#: 765 MiB for a step of short rows, so a 1000 MiB cap fails the written job and the first rung.
TINY_SCENARIOS = (
    Scenario("tiny-7b-card", "1000MiB", "7b-32k", seq=1024, micro=4, accum=2, max_steps=2),
    Scenario(
        "tiny-7b-long-row", "1000MiB", "7b-32k", seq=1024, micro=4, accum=2, max_steps=4, long_row_step=3
    ),
)


def steady(s: Scenario, suffix: str, steps: int) -> Scenario:
    """``s``'s job as a steady workload to time steps on: uncapped (no allocator retries near a
    cap), every row short (no long row), saving only after its last step."""
    return dataclasses.replace(
        s, name=f"{s.name}-{suffix}", card=UNCAPPED, max_steps=steps, save_steps=steps, long_row_step=None
    )


def for_card(card: str, tiny: bool) -> list[Scenario]:
    """The scenarios of one card size (``all``: every scenario); a card with none is an error."""
    table = TINY_SCENARIOS if tiny else SCENARIOS
    chosen = [s for s in table if card in ("all", s.card)]
    if not chosen:
        cards = sorted({s.card for s in table})
        raise SystemExit(f"--card {card}: no scenario on that card; use one of {cards} or all")
    return chosen
