"""The implementation of ``weighted_accum``; import from the top-level package.

One module per concept (see ``docs/design.md``, "Layout"): ``errors`` (the
exception), ``numerics`` (tally, compute dtypes, the finiteness reduction),
``base`` (the state types and the counter table), ``tree_utils`` (leaf paths,
tree matching, placement), ``validation`` (every input check), then the
features built on them.
"""
