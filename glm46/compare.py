"""`python -m glm46.compare <sweep dir or run dirs...>`: the command's public name; the code is glm46.app.compare."""

import sys

from glm46.app.compare import main

if __name__ == "__main__":
    sys.exit(main())
