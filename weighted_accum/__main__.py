"""``python -m weighted_accum``: the demo (see ``weighted_accum._src.demo``)."""

import sys

from weighted_accum._src.demo import main

if __name__ == "__main__":
  sys.exit(main())
