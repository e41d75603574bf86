"""Benches of the code's own structure: the import graph of the rooms."""
