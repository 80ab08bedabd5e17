"""`python -m glm46.compare <sweep dir or run dirs...>`: the public name; the code is glm46.reports.sweep_summary."""

import sys

from glm46.reports.sweep_summary import main

if __name__ == "__main__":
    sys.exit(main())
