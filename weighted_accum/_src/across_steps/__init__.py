"""Accumulation across jitted steps with optax.

``multi_steps`` (``WeightedMultiSteps``, a drop-in for ``optax.MultiSteps``,
and its counters), ``multi_steps_step`` (its state and its one-conditional
step) and ``train_state`` (flax's ``TrainState`` with a weight).
"""
