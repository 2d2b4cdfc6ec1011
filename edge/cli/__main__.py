"""`python -m edge.cli`: the edge command."""
import sys

from edge.cli import main

sys.exit(main())
