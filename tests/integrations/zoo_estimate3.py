"""The zoo's third round: models whose construction or forward needs real values: data-dependent init,
narrow fake kernels, value checks in the forward.

Every setting not given here is the library's default.
"""

from __future__ import annotations

from zoo import Entry

ESTIMATE3: list[Entry] = []
