"""Accumulation inside one jitted step: ``value_and_grad`` (the public
function and its loop over the microbatches), ``microbatch_args`` (roles,
split), ``microbatch_terms`` (loss terms), ``microbatching_spmd`` (the same
loop in a ``shard_map`` under plain ``jit`` with ``axis_name``),
``optax_microbatching``."""
