"""The one contract between the supervisor and the trainer child: the only part of
``trainer_child`` that ``supervisor/`` and ``policies/`` import (``tests/test_import_graph.py``).

No torch: the supervisor imports these modules and must never pull it in; the files are read
through pydantic.

The supervisor writes an :class:`~.spec.AttemptSpec` to ``attempt-NNN/spec.json`` and starts
``python -m qlora_supervise.trainer_child --spec attempt-NNN/spec.json``. The child speaks back
through files, never through log scraping:

* ``spec.events_file``: one JSON object per line (:func:`.events.event_line`), read back into
  one typed event each by :func:`.events.parse_event` (one discriminated union on ``event``);
* ``spec.error_file``: an :class:`~.report.ErrorReport`, written atomically, on any failure;
* the exit code, one of the reserved :class:`~.codes.ExitCode` values.

Under torchrun (``knobs.world_size`` > 1) every rank runs the child with the same spec and writes
its own events and error report, rank N at :func:`.spec.rank_file` (``error.rank1.json``,
``child-events.rank1.jsonl``; rank 0 at the paths the spec names); the report says which rank
(``rank``, ``local_rank``, ``world_size``) and when its exception was caught (``time``). Rank 0
alone writes checkpoints and the adapter.

The rooms:

* :mod:`.codes` exit codes, stages, failure kinds; :mod:`.spec` the attempt spec and its knobs;
  :mod:`.events` the events file, with :mod:`.memory_numbers` (the child's memory and its one
  peak rule); :mod:`.report` the error report, with :mod:`.oom_message`
  (the OOM message's numbers) and :mod:`.allocator_facts` (the allocator's peaks);
* :mod:`.allocator` the allocator settings (``PYTORCH_ALLOC_CONF``), one merge rule for both sides;
  :mod:`.devices` the card each rank trains on; :mod:`.byte_sizes` byte sizes, read and written;
* :mod:`.durable`, :mod:`.checkpoint_dirs`, :mod:`.checkpoints`, :mod:`.disk_space`,
  :mod:`.processes`, :mod:`.data_rows`, :mod:`.attempt_facts`: the files and processes both sides
  read the same way; :mod:`.entry` the child's ``python -m`` entry points.
"""
