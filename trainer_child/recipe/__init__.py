"""How the child trains: the QLoRA recipe, its data, the resume (rank reduction), import stack, tiny model."""
