"""The QLoRA trainer child: one attempt of the recipe, speaking through ``contract/``. Heavy imports
(torch, transformers, peft, trl) live in its modules, never here: ``contract`` stays light."""
