"""Comparing and drawing runs: the statistics of evaluation reports (`analysis.stats`:
per-arm spread, bootstrap intervals, Welch t, per-problem tests, the checkpoint sweep's table)
and PNG plots of training curves and intervals (`analysis.plots`, matplotlib loaded only to draw).

    python -m analysis.stats summary|compare ...
    python -m analysis.plots curves|overlay ...

Standard library, numpy and (lazily) matplotlib; nothing else of the project but `opsd` leaves."""
