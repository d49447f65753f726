"""Where a leaf sits in a call's arguments, read and replaced without flattening the call.

A path is a tuple of dict keys and list or tuple indices. `spmd` records the paths of the
arrays it placed in one call (a host batch every step) and on the next call replaces only
those: no Python work per parameter. Only dicts, lists, tuples and namedtuples (optax states)
are walked; a call with other nodes is flattened whole.
"""

from typing import Any, Optional, Tuple

import jax

Path = Tuple[Any, ...]
MISSING = object()  # What `leaf_at` returns where a path leads nowhere in a nest.
_CONTAINERS = (dict, list, tuple)


def paths_of(tree: Any, positions: Any, is_leaf: Any = None) -> Optional[Tuple[Path, ...]]:
    """The paths of the leaves at ``positions`` of ``tree`` flattened (with ``is_leaf``), or
    None if one of them sits inside a node other than a dict, a list or a tuple.

    Example:
      >>> import collections
      >>> State = collections.namedtuple("State", "count mu")
      >>> paths_of(((1, {"x": 2}), {}), [1]), paths_of((State(1, [2, 3]),), [2])
      (((0, 1, 'x'),), ((0, 1, 1),))
    """
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    paths = []
    for i in positions:
        path, node = [], tree
        for key in flat[i][0]:
            k = _index(node, key)
            if k is None:
                return None
            path.append(k)
            node = node[k]
        paths.append(tuple(path))
    return tuple(paths)


def _index(node, key):
    """What indexes ``node`` at JAX's path entry ``key``, or None (a node not walked here)."""
    if type(node) in _CONTAINERS:
        return key.key if isinstance(key, jax.tree_util.DictKey) else getattr(key, "idx", None)
    if _is_namedtuple(node) and isinstance(key, jax.tree_util.GetAttrKey):
        return node._fields.index(key.name) if key.name in node._fields else None
    return None


def _is_namedtuple(node):
    return isinstance(node, tuple) and isinstance(getattr(type(node), "_fields", None), tuple)


def leaf_at(tree: Any, path: Path) -> Any:
    """What sits at ``path`` in ``tree``, or `MISSING`.

    Example:
      >>> leaf_at(((1, {"x": 2}), {}), (0, 1, "x")), leaf_at((1,), (3,)) is MISSING
      (2, True)
    """
    for k in path:
        if type(tree) not in _CONTAINERS and not _is_namedtuple(tree):
            return MISSING
        try:
            tree = tree[k]
        except (KeyError, IndexError, TypeError):
            return MISSING
    return tree


def with_leaf(tree: Any, path: Path, leaf: Any) -> Any:
    """``tree`` with ``leaf`` at ``path``: the containers along the path copied, the rest shared.

    Example:
      >>> import collections
      >>> State = collections.namedtuple("State", "count mu")
      >>> with_leaf(((1, {"x": 2}), {}), (0, 1, "x"), 5), with_leaf(State(1, 2), (1,), 5)
      (((1, {'x': 5}), {}), State(count=1, mu=5))
    """
    if not path:
        return leaf
    k, child = path[0], with_leaf(tree[path[0]], path[1:], leaf)
    if isinstance(tree, dict):
        return {**tree, k: child}
    if isinstance(tree, list):
        return tree[:k] + [child] + tree[k + 1:]
    if _is_namedtuple(tree):
        return type(tree)._make(tree[:k] + (child,) + tree[k + 1:])
    return tree[:k] + (child,) + tree[k + 1:]
