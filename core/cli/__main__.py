"""``python -m slipstream.cli``: the ``slipstream`` command."""

import sys

from . import main

if __name__ == "__main__":  # importing it (documentation tools do) runs nothing
    sys.exit(main())
