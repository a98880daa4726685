"""Accumulation inside one jitted step: a loop over a batch's microbatches.

``value_and_grad`` (``microbatched_value_and_grad``: its options, ``f`` and
``f.accumulate``), ``microbatching`` (the loop), ``microbatch_args``
(argument roles and the split into microbatches), ``microbatch_terms`` (loss
terms with normalisers), ``spmd_plan`` and ``microbatching_spmd`` (the loop
under plain ``jit`` over data axes: its plan, its run) and
``optax_microbatching`` (an accumulator for ``optax.microbatching``).
"""
