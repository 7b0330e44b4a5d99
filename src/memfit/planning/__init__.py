"""Deciding: the exact solver, ``memfit.plan`` and FSDP2 sharding; pure functions over records.

The step-memory model the solver constrains lives one level below, in :mod:`memfit.stepmodel`,
because measuring (profile, estimate) adds up the same events.
"""
