"""Accumulation across jitted steps with optax.

``multi_steps`` (``WeightedMultiSteps``, a drop-in for ``optax.MultiSteps``,
and its counters), ``multi_steps_step`` (its one-conditional step),
``wrapper_state`` (its state), ``held_state`` (that state as Flax NNX holds
it), ``peek`` (``peek_mean`` and ``discard`` of either window) and
``train_state`` (flax's ``TrainState`` with a weight).
"""
