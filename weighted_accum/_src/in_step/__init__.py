"""Accumulation inside one jitted step: ``value_and_grad`` (the public
function), ``microbatching`` (the loop), ``microbatch_args`` (roles, split),
``microbatch_terms`` (loss terms), ``microbatching_spmd`` (under
plain ``jit`` with ``axis_name``), ``optax_microbatching``."""
