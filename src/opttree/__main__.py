"""`python -m opttree ...` (as `torchrun -m opttree ...` starts each rank) runs the `opttree` command."""

import sys

from .cli import main

sys.exit(main())
