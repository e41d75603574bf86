"""The adapter merged into the base model in its own low-memory process, and its memory plan."""
