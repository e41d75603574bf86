"""The QLoRA trainer child: one attempt of the recipe, speaking through ``contract/``.

Heavy imports (torch, transformers, peft, trl, bitsandbytes) live in the modules of this
package, never here, so that ``contract`` stays importable by the supervisor.
"""
