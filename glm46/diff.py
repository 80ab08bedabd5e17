"""`python -m glm46.diff A B`: the command's public name; the code is glm46.reports.config_diff."""

import sys

from glm46.reports.config_diff import main

if __name__ == "__main__":
    sys.exit(main())
