"""Comparing and drawing runs: the statistics of evaluation reports (`opsd.analysis.stats`:
per-arm spread, bootstrap intervals, Welch t, per-problem tests, the checkpoint sweep's table)
and PNG plots of training curves and intervals (`opsd.analysis.plots`, matplotlib loaded only to draw),
and the sampled tokens of runs and grids (`opsd.analysis.tokens`: `tokens/sampled` of metrics.jsonl).

    python -m opsd.analysis.stats summary|compare|tokens ...
    python -m opsd.analysis.plots curves|overlay ...

Standard library, numpy and (lazily) matplotlib; nothing else of the project but `opsd` leaves."""
