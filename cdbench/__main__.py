"""``python -m cdbench``: the command line, where the ``cdbench`` script is not installed (a GPU host
running the working tree)."""

from cdbench.cli.main import main

main()
