"""What this machine can do, and how much more memory this process can allocate on it now.

Facts are read once per process and cached. ``bf16_native`` means the hardware computes in
bf16 (CUDA compute capability 8.0 or newer; on a CPU the AVX512-BF16 or AMX-BF16 flags);
``torch.cuda.is_bf16_supported()`` alone is not trusted because it also counts emulation.

Example:
    >>> facts = device_facts("cpu")
    >>> facts.type
    'cpu'
    >>> recommend_precision(facts) in {"bf16", "fp16", "fp32"}
    True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.records import Record
from memfit.vocab import MIXED_PRECISIONS, PrecisionName

__all__ = [
    "ROOM_MARGIN",
    "DeviceFacts",
    "Room",
    "address_space_limited",
    "all_device_facts",
    "default_device",
    "device_facts",
    "free_cores",
    "model_device",
    "recommend_precision",
    "recommendation_line",
    "resolve_device",
    "return_freed_address_space",
    "room",
    "room_needed",
    "seconds_of",
    "slow_precisions",
    "synchronize",
    "unwrap",
]


@dataclass
class DeviceFacts(Record):
    """What one device supports, and how fast."""

    name: str
    """``"cpu"`` or ``"cuda:0"``."""
    type: str
    """The torch device type: ``"cpu"``, ``"cuda"``, ``"mps"``."""
    description: str
    total_memory: int
    """Bytes of memory (system RAM for the CPU)."""
    capability: tuple[int, int] | None = None
    """CUDA compute capability, or None."""
    bf16_runs: bool = False
    """bf16 autocast works on this device (possibly emulated)."""
    bf16_native: bool = False
    """bf16 arithmetic is done in hardware, so it is fast."""
    fp16_runs: bool = False
    fp16_native: bool = False
    autocast_dtypes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


@functools.cache
def _cpu_facts() -> DeviceFacts:
    flags = _cpu_flags()
    # Only AMX tiles make PyTorch's bf16 (or fp16) steps on a CPU reliably faster than fp32.
    # AVX512-BF16 has dot products but no tile unit: on a 2-core AMD EPYC with it, memfit bench
    # measured bf16 steps from 0.8x to 9.2x of fp32's (issue 28: bf16/full at 9.19x) and fp16 at
    # 10-16x. So a CPU's low precision counts as native (recommended for speed) only with AMX;
    # without it, it still runs (it saves memory) and is not recommended for speed.
    bf16_native = "amx_bf16" in flags
    fp16_native = "amx_fp16" in flags
    notes = []
    if not bf16_native:
        if "avx512_bf16" in flags:
            notes.append("bf16 works on this CPU with AVX512-BF16 but no AMX: not reliably faster than fp32")
        else:
            notes.append("bf16 works on this CPU but is emulated (no AVX512-BF16 or AMX) and slow")
    if not fp16_native:
        has = " (it has AVX512-FP16, but no AMX-FP16)" if "avx512_fp16" in flags else " (no AMX-FP16)"
        notes.append(f"fp16 works on this CPU but is emulated{has} and slow")
    return DeviceFacts(
        name="cpu",
        type="cpu",
        description=f"{_cpu_model()} ({os.cpu_count()} cores)",
        total_memory=_cpu_memory(),
        bf16_runs=True,
        bf16_native=bf16_native,
        fp16_runs=True,
        fp16_native=fp16_native,
        autocast_dtypes=list(MIXED_PRECISIONS),
        notes=notes,
    )


@functools.cache
def _cuda_facts(index: int) -> DeviceFacts:
    props = torch.cuda.get_device_properties(index)
    cap = (props.major, props.minor)
    bf16_native = cap >= (8, 0)
    fp16_native = cap >= (7, 0)
    notes = []
    if not bf16_native:
        notes.append(f"compute capability {cap[0]}.{cap[1]} < 8.0: no native bf16; use fp16")
    if cap < (7, 0):
        notes.append("no tensor cores: fp16 saves memory but little time")
    return DeviceFacts(
        name=f"cuda:{index}",
        type="cuda",
        description=props.name,
        total_memory=int(props.total_memory),
        capability=cap,
        bf16_runs=bf16_native,
        bf16_native=bf16_native,
        fp16_runs=True,
        fp16_native=fp16_native,
        autocast_dtypes=(list(MIXED_PRECISIONS) if bf16_native else ["fp16"]),
        notes=notes,
    )


def device_facts(device: str | torch.device | None = None) -> DeviceFacts:
    """Facts about one device (default: :func:`default_device`)."""
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda":
        return _cuda_facts(dev.index if dev.index is not None else torch.cuda.current_device())
    if dev.type == "cpu":
        return _cpu_facts()
    return DeviceFacts(
        name=str(dev),
        type=dev.type,
        description=str(dev),
        total_memory=0,
        fp16_runs=True,
        autocast_dtypes=["fp16"],
        notes=[f"memfit knows little about {dev.type}; precision support is assumed"],
    )


def all_device_facts() -> list[DeviceFacts]:
    """Facts about the CPU and every visible CUDA device."""
    facts = [_cpu_facts()]
    if torch.cuda.is_available():
        facts += [_cuda_facts(i) for i in range(torch.cuda.device_count())]
    return facts


def model_device(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (or buffer); the CPU for a module with neither.

    Example:
        >>> model_device(nn.Linear(2, 2))
        device(type='cpu')
    """
    first: torch.Tensor | None = next(iter(module.parameters()), None)
    if first is None:
        first = next(iter(module.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``: CUDA runs kernels asynchronously, so a clock
    read before and after a step must wait for them; elsewhere, nothing to wait for."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_of(fn: Callable[[], object], device: torch.device) -> float:
    """The wall seconds ``fn()`` took, ``device``'s queued work finished at both ends
    (:func:`synchronize`).

    Example:
        >>> seconds_of(lambda: sum(range(1000)), torch.device("cpu")) >= 0
        True
    """
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def _running_threads() -> int | None:
    """The kernel's count of threads runnable right now, all processes (``/proc/loadavg``'s
    fourth field, ``running/total``), or None where it cannot be read."""
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def free_cores(readings: int = 5, apart: float = 0.002) -> int | None:
    """CPU cores that no other thread of this machine keeps busy now, or None where that is
    unknown (no ``/proc/loadavg``, or this process may run on only some of the cores).

    The least of ``readings`` counts of runnable threads, ``apart`` seconds apart, less the one
    reading them: a thread that runs only now and then (a pool's worker winding down) is not
    counted, a process that keeps a core busy is.

    Example:
        >>> n = free_cores()
        >>> n is None or 0 <= n <= (os.cpu_count() or 1)
        True
    """
    cores, affinity = os.cpu_count(), getattr(os, "sched_getaffinity", None)
    if cores is None or affinity is None or len(affinity(0)) != cores:
        return None
    counts = []
    for k in range(readings):
        if k:
            time.sleep(apart)
        counts.append(_running_threads())
    if any(c is None for c in counts):
        return None
    others = min(c for c in counts if c is not None) - 1
    return max(0, cores - others)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 wraps in place, so it is the model itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def default_device() -> torch.device:
    """The first CUDA device when there is one, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def resolve_device(value: str, what: str = "train.device") -> torch.device:
    """The device a config names (``"auto"``: :func:`default_device`), checked to exist here.

    Raises:
        ConfigError: the name is not a device, or this machine (or this build of torch)
            does not have it.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if value == "auto":
        return default_device()
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"{what} {value!r} is not a device; use 'auto', 'cpu' or 'cuda:N'.") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = (
                "this torch has no CUDA support"
                if torch.version.cuda is None
                else "no CUDA device is visible"
            )
            raise ConfigError(f"{what} is {value!r} but {built}; use 'cpu' or 'auto'.")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{what} is {value!r} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                "use cuda:0 or 'auto'."
            )
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError(f"{what} is {value!r} but MPS is not available here; use 'cpu' or 'auto'.")
    elif dev.type != "cpu":
        raise ConfigError(f"{what} {value!r} is not supported; use 'auto', 'cpu', 'cuda:N' or 'mps'.")
    return dev


def recommend_precision(facts: DeviceFacts) -> PrecisionName:
    """The precision the device runs well: bf16 if native, fp16 on older GPUs, else fp32."""
    if facts.bf16_native:
        return "bf16"
    if facts.type == "cuda" and facts.fp16_native:
        return "fp16"
    return "fp32"


def slow_precisions(facts: DeviceFacts) -> list[PrecisionName]:
    """The mixed precisions this device runs without computing them natively.

    They still halve what the forward keeps, so they may be chosen to save memory, but
    never recommended for speed: emulated bf16 on a CPU can take many times fp32's step.

    Example:
        >>> cpu = DeviceFacts("cpu", "cpu", "CPU", 0, bf16_runs=True, fp16_runs=True)
        >>> slow_precisions(cpu)
        ['bf16', 'fp16']
    """
    return [p for p in MIXED_PRECISIONS if getattr(facts, f"{p}_runs") and not getattr(facts, f"{p}_native")]


def recommendation_line(facts: DeviceFacts) -> str:
    """One line of advice for this device (what ``memfit doctor`` prints).

    Example:
        >>> recommendation_line(DeviceFacts("cpu", "cpu", "CPU", 0, bf16_runs=True)).split("(")[1]
        'bf16 runs here but is not native: not reliably faster, use it only to save memory)'
    """
    choice = recommend_precision(facts)
    slow = slow_precisions(facts)
    if choice == "bf16":
        return "use bf16 autocast"
    if choice == "fp16":
        return "use fp16 with loss scaling"
    if not slow:
        return "fp32 compute; save memory with checkpointing"
    verb = "runs here but is" if len(slow) == 1 else "run here but are"
    return (
        f"fp32 compute; save memory with checkpointing ({' and '.join(slow)} {verb} not native: not "
        "reliably faster, use "
        f"{'it' if len(slow) == 1 else 'them'} only to save memory)"
    )


#: What a step's estimated extra bytes are multiplied by, and what is added, before they
#: are said to fit a :class:`Room`: allocator rounding and fragmentation, the measuring
#: tools' own bookkeeping, an estimate a few percent short.
ROOM_MARGIN = (1.10, 16 * 2**20)


def room_needed(extra_bytes: int) -> int:
    """The room ``extra_bytes`` more need with :data:`ROOM_MARGIN`."""
    scale, pad = ROOM_MARGIN
    return int(extra_bytes * scale) + pad


@dataclass(frozen=True)
class Room:
    """How many more bytes this process can allocate on a device now, and where that was read.

    Example:
        >>> r = Room(free=2**30, source="MemAvailable")
        >>> r.fits(2**29), r.fits(2**30)
        (True, False)
        >>> r.usable < r.free
        True
    """

    free: int
    """Bytes this process can still allocate (never below 0)."""
    source: str
    """Which limit is the tightest, in words (``"RLIMIT_AS"``, ``"cgroup memory.max"``, ...)."""

    def fits(self, extra_bytes: int) -> bool:
        """True when ``extra_bytes`` more, with :data:`ROOM_MARGIN`, fit the room."""
        return room_needed(extra_bytes) <= self.free

    @property
    def usable(self) -> int:
        """The largest extra bytes :meth:`fits` accepts."""
        scale, pad = ROOM_MARGIN
        return max(0, int((self.free - pad) / scale))


def _proc_kib(path: str, key: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(64).strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_room() -> int | None:
    """What the process's memory cgroup still allows (v2 ``memory.max``, or v1), or None."""
    for limit, used in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        cap, now = _read_int(limit), _read_int(used)
        if cap is not None and now is not None and cap < 2**60:
            return cap - now
    return None


def _cpu_room() -> Room:
    limits: dict[str, int] = {}
    available = _proc_kib("/proc/meminfo", "MemAvailable")
    if available is not None:
        limits["MemAvailable"] = available
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    size = _proc_kib("/proc/self/status", "VmSize")
    if soft != resource.RLIM_INFINITY and size is not None:
        limits["RLIMIT_AS"] = soft - size
    cgroup = _cgroup_room()
    if cgroup is not None:
        limits["cgroup memory.max"] = cgroup
    if not limits:
        return Room(free=max(0, _cpu_memory()), source="physical memory")
    source = min(limits, key=lambda k: limits[k])
    if source == "RLIMIT_AS":  # the room is what can be allocated: See Note [address space under RLIMIT_AS]
        return_freed_address_space()
    return Room(free=max(0, limits[source]), source=source)


def _cuda_room(device: torch.device) -> Room:
    if device.index is None:  # torch.cuda's per-process fraction wants an index: "cuda" is the current one
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    cached = reserved - torch.cuda.memory_allocated(device)
    source = "torch.cuda.mem_get_info + the caching allocator's free blocks"
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        capped = int(fraction(device) * total) - reserved
        if capped < free:
            free, source = capped, "set_per_process_memory_fraction + the caching allocator's free blocks"
    return Room(free=max(0, free + cached), source=source)


def room(device: str | torch.device) -> Room | None:
    """How much more this process can allocate on ``device`` now (None: unknown, e.g. MPS).

    CPU: the tightest of ``MemAvailable``, the address-space limit (``RLIMIT_AS`` less the
    address space in use; where it is the tightest, freed memory is made to return its address
    space: See Note [address space under RLIMIT_AS]) and the memory cgroup's limit. CUDA: the
    device's free memory (capped by ``torch.cuda.set_per_process_memory_fraction``) plus what the caching
    allocator holds unused.

    Example:
        >>> r = room("cpu")
        >>> r is not None and r.free > 0
        True
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return _cpu_room()
    if dev.type == "cuda":
        return _cuda_room(dev)
    return None


# Note [address space under RLIMIT_AS]
# Under a limit on the address space (RLIMIT_AS), what counts is memory mapped, not memory
# used. glibc's malloc keeps what a step frees mapped in its heap (its mmap threshold grows
# with every large block freed, up to 32 MiB, and the heap is trimmed only at its top), so
# after a few steps of different shapes (planning's, in micro-batches, checkpointed) the
# process holds hundreds of MiB of freed address space that a step of another shape cannot
# reuse, and a plan that fits the limit runs out of it. Where RLIMIT_AS is the tightest
# limit, memfit asks glibc to map every allocation of 64 KiB or more on its own
# (``mallopt(M_MMAP_THRESHOLD)``, what ``MALLOC_MMAP_THRESHOLD_=65536`` does at start-up), so
# freeing a tensor returns its address space (and to keep to the malloc arenas it has:
# another thread's arena would reserve 64 MiB of address space), and measuring keeps its
# snapshot of the weights in a file (:func:`memfit.measuring.preserve.preserved`). The price is a page fault
# per fresh page of every large tensor, paid only by processes under such a limit. Other
# C libraries (musl) and other systems are left alone.

#: glibc's ``mallopt`` parameters for the mmap threshold and the number of arenas, and what
#: memfit sets them to (a thread's new arena would reserve 64 MiB of address space).
_M_MMAP_THRESHOLD, _MAP_FROM, _M_ARENA_MAX = -3, 64 * 1024, -8
_MAPPED: list[bool] = []
"""Whether glibc was told (once per process; empty: not yet)."""


def address_space_limited(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` is the CPU and the address-space limit (``RLIMIT_AS``) is the
    tightest limit on its room. See Note [address space under RLIMIT_AS].

    Example:
        >>> address_space_limited("meta")
        False
    """
    if torch.device(device).type != "cpu":
        return False
    return _cpu_room().source == "RLIMIT_AS"


def return_freed_address_space() -> bool:
    """Have glibc map every allocation of 64 KiB or more on its own, so freeing it returns
    its address space, and keep to the arenas it has; True where that was done (glibc),
    False elsewhere. Once per process. See Note [address space under RLIMIT_AS].
    """
    if not _MAPPED:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            done = hasattr(libc, "gnu_get_libc_version") and bool(libc.mallopt(_M_MMAP_THRESHOLD, _MAP_FROM))
            if done:
                libc.mallopt(_M_ARENA_MAX, 1)
        except Exception:  # no glibc, or no room left to ask: the allocator stays as it is
            done = False
        _MAPPED.append(done)
    return _MAPPED[0]
