"""`python -m kvdiff.cli`, as `python -m kvdiff` and the `kvdiff` script."""

from kvdiff.cli import main

main()
