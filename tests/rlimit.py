"""The address-space limit the subprocess tests train under (Linux: ``RLIMIT_AS``, ``/proc``)."""

from __future__ import annotations

import resource

__all__ = ["address_space", "lift_address_space_limit", "limit_address_space"]


def address_space() -> int:
    """Bytes of address space this process uses now (``VmSize``)."""
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmSize"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def limit_address_space(extra: int) -> int:
    """Limit the address space to what is in use now plus ``extra`` bytes; returns the limit."""
    limit = address_space() + extra
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit


def lift_address_space_limit() -> None:
    """Raise the limit back to the hard one."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
