"""In-memory executable cache keyed by module fingerprint, device and compile options."""
from __future__ import annotations

import collections
import hashlib
import threading
from dataclasses import dataclass, field


def fingerprint(module_text: str) -> str:
    return hashlib.sha256(module_text.encode()).hexdigest()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# Each XLA:CPU executable holds its JIT-compiled code in tens to hundreds of memory mappings
# (59 for a 2-layer GPT-2), and Linux allows a process 65,530 (vm.max_map_count). With 512
# entries, a process that compiled 84 transformers models one after another (the model sweep)
# kept enough of them to exhaust that: LLVM's JIT failed with "Cannot allocate memory" and the
# process crashed. An executable a live graph holds stays loaded whatever the cache does; the
# cache only keeps others for a recompile of the same module (a retrace after
# torch._dynamo.reset(), a new guard set with the same graph), which a few dozen cover.
DEFAULT_MAX_ENTRIES = 64


@dataclass
class ExecutableCache:
    """LRU map `key -> loaded executable`. An eviction only ever costs a recompile."""

    max_entries: int = DEFAULT_MAX_ENTRIES
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self):
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            exe = self._entries.get(key)
            if exe is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return exe

    def put(self, key, exe) -> None:
        with self._lock:
            self._entries[key] = exe
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.stats.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


executable_cache = ExecutableCache()
