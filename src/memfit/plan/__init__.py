"""Deciding: the step-memory simulator, the exact solver, and ``plan`` / ``apply``.

``memfit.plan`` is the planning *function* (re-exported from :mod:`memfit.plan.planner`);
import this package's modules with ``from memfit.plan.solver import solve``, not with
``import memfit.plan.solver as ...`` (the attribute ``memfit.plan`` is the function).
"""
