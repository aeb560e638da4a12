"""What arrives at the scheduler.

- :mod:`~cdbench.workloads.request`: :class:`Request`, the contract with the scheduler;
- :mod:`~cdbench.workloads.corpora`: JSONL corpora of real specs (``load_corpus``, ``resolve_corpus``);
- :mod:`~cdbench.workloads.config`, :mod:`~cdbench.workloads.generator`: ``WorkloadConfig`` →
  ``generate(config, vocab) -> Workload``; :mod:`~cdbench.workloads.arrivals`, :mod:`~cdbench.workloads.lengths`;
- :mod:`~cdbench.workloads.instances`: validated oracle instances, pooled and cached
  (JSON Schema, regex and grammar generators in ``json_instances``, ``regex_instances``,
  ``grammar_instances``; validators in ``validate``);
- :mod:`~cdbench.workloads.token_sources` (random walk over a mask row), :mod:`~cdbench.workloads.drafts`
  (speculative-decoding drafts);
- :mod:`~cdbench.workloads.trace`: JSONL trace export, validated import and replay
  (``WorkloadConfig.trace``; ``docs/trace_format.md``).

Submodules are imported on use, so ``import cdbench.workloads.request`` stays light.
"""
