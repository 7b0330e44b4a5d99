"""The zoo's third round: models whose blocks do not run in module order, or whose depth is random in
training.

Every setting not given here is the library's default.
"""

from __future__ import annotations

from zoo import Entry

ORDER3: list[Entry] = []
