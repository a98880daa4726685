"""The window core: the state, its arithmetic and its one open/fill/close path.

``base`` (``AccumState`` and the counter table), ``numerics`` (exact weight
tallies, NaN-safe finiteness marks), ``tree_utils`` (leaf paths, shardings),
``accumulation`` (``init``, the one accumulate path, ``from_buffers``),
``window`` (the one close path), ``finishing`` (the closers' kernels),
``open_window`` (the kernels of
``peek_mean`` and ``discard``) and ``loss_scale`` (``DynamicLossScale``).
"""
