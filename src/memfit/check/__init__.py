"""Stability: mixed precision against fp32, overflow attribution, and training guards."""

from memfit.check.attribution import OverflowWatch, attribute
from memfit.check.stability import check_stability
from memfit.check.verdict import Thresholds, judge

__all__ = ["OverflowWatch", "Thresholds", "attribute", "check_stability", "judge"]
