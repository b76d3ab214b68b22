"""Comparing and drawing runs: the statistics of evaluation reports (`opsd.analysis.stats`, the
command line: per-arm spread, bootstrap intervals, Welch t, per-problem tests, the checkpoint
sweep's table; split by job into `reports` (reading and checking eval reports), `significance`
(the statistics and the verdict) and `comparison` (each command's numbers)), claims of sameness
and reach (`opsd.analysis.evidence`), PNG plots of training curves and intervals
(`opsd.analysis.plots`, matplotlib loaded only to draw), and the sampled tokens of runs and grids
(`opsd.analysis.tokens`: `tokens/sampled` of metrics.jsonl).

    python -m opsd.analysis.stats summary|compare|tokens|equivalence|reach ...
    python -m opsd.analysis.plots curves|overlay ...

Standard library, numpy, scipy and (lazily) matplotlib; nothing else of the project but `opsd` leaves."""
