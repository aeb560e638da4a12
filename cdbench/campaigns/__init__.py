"""Campaigns: an experiment as a file (docs/campaigns.md).

``spec`` reads and checks the campaign file, ``plan`` expands it into runs (folders, dependencies,
configurations), ``execute`` runs what is missing as local processes, and ``report`` judges the comparisons
with the fidelity machinery (:mod:`cdbench.reports.fidelity`), from run folders or a pack.
"""
