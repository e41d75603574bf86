"""The run record: the run directory, the attempt journal, ``state.json`` and the event log."""
