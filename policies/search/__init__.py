"""The search over candidate configs: before the first attempt and after a memory failure."""
