"""Deciding: the step-memory simulator, the exact solver, and ``plan`` / ``apply``."""
