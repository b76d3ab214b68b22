"""Comparing and drawing runs: the statistics of evaluation reports (`analysis.stats`:
per-arm spread, bootstrap intervals, Welch t, per-problem tests, the checkpoint sweep's table)
and PNG plots of training curves and intervals (`analysis.plots`, matplotlib loaded only to draw),
and the sampled tokens of runs and grids (`analysis.tokens`: `tokens/sampled` of metrics.jsonl).

    python -m analysis.stats summary|compare|tokens ...
    python -m analysis.plots curves|overlay ...

Standard library, numpy and (lazily) matplotlib; nothing else of the project but `opsd` leaves."""
