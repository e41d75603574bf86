"""How the child trains: the QLoRA recipe (4-bit load, prepare, LoRA, SFT trainer), its data, the
resume (with rank reduction), the import stack; the tiny model for the demo and the tests."""
