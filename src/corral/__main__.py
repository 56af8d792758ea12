"""`python -m corral` is the `corral` command (the demo's sim backends start this way)."""

from corral.cli import main

main()
