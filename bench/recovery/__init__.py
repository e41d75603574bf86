"""bench/recovery: OOM recovery measured side by side (qlora-supervise, a restart loop,
``auto_find_batch_size``); ``run.py`` runs one card size, ``report.py`` writes RESULTS.md."""
