"""Accumulation inside one jitted step: a loop over a batch's microbatches.

``microbatching`` (``microbatched_value_and_grad``), ``microbatch_args``
(argument roles and the split into microbatches), ``microbatch_terms`` (loss
terms with normalisers), ``microbatching_spmd`` (the loop under named data
axes) and ``optax_microbatching`` (an accumulator for
``optax.microbatching``).
"""
