"""Benchmarking: strategies measured side by side, the Pareto front, and their report.

:func:`memfit.bench` (in :mod:`memfit.benchmarking.sweep`) runs each strategy on a fresh
copy of the model, interleaved; :mod:`.strategies` names PyTorch's own ways to save memory,
:mod:`.planned` adds the planner's, :mod:`.pareto` finds the front and the recommendation,
:mod:`.report` and :mod:`.plot` write the tables and the picture.
"""
