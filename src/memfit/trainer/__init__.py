"""The library's training loop: :class:`memfit.Trainer` and what it stands on.

A :class:`~memfit.trainer.trainer.Trainer` owns a :class:`~memfit.trainer.stepper.Stepper`
(one guarded, tracked step; a re-plan after running out of memory, :mod:`~memfit.trainer.oom`),
callbacks, and its state files (:mod:`~memfit.trainer.state`, sharded under FSDP2:
:mod:`~memfit.trainer.sharded_state`); :mod:`~memfit.trainer.signals` stops it cleanly on
Ctrl-C or SIGTERM; :mod:`~memfit.trainer.distributed` wraps a model for DDP or FSDP2.
"""
