"""A bound on YAML alias expansion, checked on the node graph before any value is built.

An alias (``*a``) reuses the node its anchor (``&a``) names, so a file of a few hundred bytes
can stand for billions of values ("billion laughs": nine levels of ten aliases each). PyYAML
shares the aliased objects, but everything that walks the result afterwards (the duplicate-key
check, pydantic) visits each use again, and the time grows exponentially with the levels.
``yaml.compose`` builds the graph with one node per anchor, in time linear in the file; its
expanded size is counted here with one visit per node (memoized), so the check is fast
whatever the expansion would be.
"""

from __future__ import annotations

import yaml

#: Nodes a job file may expand to, aliases counted at each use. A full job file has about 100;
#: aliases that share a list of target modules or a path stay far below this.
MAX_EXPANDED_NODES = 10_000


class AliasBombError(ValueError):
    """The document's aliases expand past :data:`MAX_EXPANDED_NODES` (or refer to themselves)."""


def check_expansion(root: yaml.Node | None, limit: int = MAX_EXPANDED_NODES) -> int:
    """The number of nodes ``root`` expands to; raises AliasBombError past ``limit``."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise AliasBombError("an alias refers to a node that contains it (an endless expansion)")
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(item) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        open_nodes.discard(key)
        if total > limit:
            raise AliasBombError(f"its aliases expand to more than {limit} values")
        sizes[key] = total
        return total

    return 0 if root is None else size(root)
