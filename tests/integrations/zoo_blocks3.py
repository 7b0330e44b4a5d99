"""The zoo's third round: models whose blocks a person picks by structure: residual units of two
sub-modules, parallel branches, one block type per stage, auxiliary heads.

Every setting not given here is the library's default.
"""

from __future__ import annotations

from zoo import Entry

BLOCKS3: list[Entry] = []
