"""Accumulation across jitted steps with optax: ``multi_steps``
(``WeightedMultiSteps``, its step and readers), ``wrapper_state`` (its state,
also as Flax NNX holds it), ``peek`` (``peek_mean``, ``discard``) and
``train_state`` (flax's ``TrainState``)."""
