"""The command line (``cdbench ...``): the only package that imports typer."""
