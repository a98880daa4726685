"""The implementation of ``weighted_accum``; import from the top-level package.

Layered subpackages (see ``docs/design.md``, "Layout"): ``errors`` (the
exception) and ``validation`` (every check of a caller's value) at the base;
``core`` (the window: state, accumulate, the one close path); then the
features built on it: ``parallel`` (windows over mesh axes),
``across_steps`` (the optax wrapper), ``in_step`` (a loop over microbatches
inside one step) and ``checkpointing`` (Orbax).
"""
