"""Where a leaf sits in a call's arguments, read and replaced without flattening the call.

A path is a tuple of dict keys and list or tuple indices from the top of a nest. `run` records
the paths of the arrays it placed in one call (a batch given as a host array every step) and, on
the next call, reads and replaces only those, so a call with hundreds of parameters costs no
Python work per parameter (`spmd.ReplicatedRunner._placed_as_before`). Only plain dicts, lists
and tuples are walked: other pytree nodes (a namedtuple, a dataclass, a custom node) have no
path here, and such calls are made canonical leaf by leaf as before.
"""

from typing import Any, Optional, Tuple

import jax

Path = Tuple[Any, ...]
MISSING = object()  # What `leaf_at` returns where a path leads nowhere in a nest.
_CONTAINERS = (dict, list, tuple)


def paths_of(tree: Any, positions, is_leaf=None) -> Optional[Tuple[Path, ...]]:
    """The paths of the leaves at ``positions`` of ``tree`` flattened (with ``is_leaf``), or
    None if one of them sits inside a node other than a dict, a list or a tuple.

    Example:
      >>> paths_of(((1, {"x": 2}), {}), [1])
      ((0, 1, 'x'),)
    """
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    paths = []
    for i in positions:
        path, node = [], tree
        for key in flat[i][0]:
            if type(node) not in _CONTAINERS:
                return None
            k = key.key if isinstance(key, jax.tree_util.DictKey) else getattr(key, "idx", None)
            if k is None:
                return None
            path.append(k)
            node = node[k]
        paths.append(tuple(path))
    return tuple(paths)


def leaf_at(tree: Any, path: Path) -> Any:
    """What sits at ``path`` in ``tree``, or `MISSING`.

    Example:
      >>> leaf_at(((1, {"x": 2}), {}), (0, 1, "x")), leaf_at((1,), (3,)) is MISSING
      (2, True)
    """
    for k in path:
        if type(tree) not in _CONTAINERS:
            return MISSING
        try:
            tree = tree[k]
        except (KeyError, IndexError, TypeError):
            return MISSING
    return tree


def with_leaf(tree: Any, path: Path, leaf: Any) -> Any:
    """``tree`` with ``leaf`` at ``path``: the containers along the path copied, the rest shared.

    Example:
      >>> with_leaf(((1, {"x": 2}), {}), (0, 1, "x"), 5)
      ((1, {'x': 5}), {})
    """
    if not path:
        return leaf
    k, child = path[0], with_leaf(tree[path[0]], path[1:], leaf)
    if isinstance(tree, dict):
        return {**tree, k: child}
    if isinstance(tree, list):
        return tree[:k] + [child] + tree[k + 1:]
    return tree[:k] + (child,) + tree[k + 1:]
