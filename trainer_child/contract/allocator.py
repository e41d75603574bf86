"""The CUDA caching allocator's settings, merged by one rule on both sides.

PyTorch reads ``PYTORCH_ALLOC_CONF`` (2.8+) and the older ``PYTORCH_CUDA_ALLOC_CONF``; both are
set so the child's torch version does not matter. The supervisor sets them in the child's
environment and the child sets them again before ``import torch`` (which covers a child started
by hand); both call :func:`allocator_env`, so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping

ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


def with_option(conf: str, option: str) -> str:
    """``conf`` (comma-separated ``key:value`` options) with ``option`` set: an earlier value of
    the same key is replaced, every other option kept in its order.

    The knob wins over a value the caller set: a rung that asked for expandable segments after a
    fragmentation OOM must get them, or the next attempt would fail the same way.
    """
    key = option.split(":", 1)[0]
    parts = [p for p in conf.split(",") if p and not p.startswith(key + ":")]
    return ",".join([*parts, option])


def allocator_env(env: Mapping[str, str], expandable_segments: bool) -> dict[str, str]:
    """The allocator variables to set over ``env`` for these knobs (empty when nothing changes)."""
    if not expandable_segments:
        return {}
    return {name: with_option(env.get(name, ""), EXPANDABLE) for name in ALLOC_CONF_VARS}
