"""Every check of a value a caller hands in, one function per kind of input,
each returning the value to store: call ``validation.weight(...)``.

Every public entry point calls these before any kernel sees the value, and
validates the value that will be STORED, after the conversion. Concrete
values are checked on the host and come back as host NumPy scalars; traced
values are converted by the same rules and come back with a validity flag
(a weight) or as NaN (a loss scale). The rules: ``docs/inputs.md``.
"""

# The namespace is the public names of its modules (imports included).
from weighted_accum._src.validation.options import *  # noqa: F403
from weighted_accum._src.validation.removed import *  # noqa: F403
from weighted_accum._src.validation.restored import *  # noqa: F403
from weighted_accum._src.validation.scaler import *  # noqa: F403
from weighted_accum._src.validation.values import *  # noqa: F403
