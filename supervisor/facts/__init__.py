"""The nouns every room shares; they depend on nothing of ours but the child's contract."""
