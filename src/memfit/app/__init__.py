"""``memfit train``: the application that turns a TOML config into a training run.

:mod:`~memfit.app.config` (the config and its rules, every value checked before any work),
:mod:`~memfit.app.setup` (check, build), :mod:`~memfit.app.resume`, :mod:`~memfit.app.run`
(setup -> resume -> fit -> report), :mod:`~memfit.app.run_report`, :mod:`~memfit.app.data`
(byte corpora and batches), :mod:`~memfit.app.schedule`, :mod:`~memfit.app.dist_plan` (rank 0
plans under torchrun, every rank runs it). The library loop it drives is :mod:`memfit.trainer`.
"""
