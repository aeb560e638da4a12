"""The engines' published A/B results on structured outputs, each predicted by cdbench.

``registry.yaml`` holds one entry a public comparison (its source, setup, the
published numbers and what the source leaves unstated) with the two cdbench
configurations that mirror its arms; :mod:`~cdbench.published.registry` is its
schema, :mod:`~cdbench.published.runner` runs both arms in ``model`` mode and
gives a verdict, :mod:`~cdbench.published.report` writes the table and the plot.
Adding an entry is data: the registry drives everything.
"""
