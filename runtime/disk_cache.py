"""Executables on disk, shared across processes.

`FX2XLA_CACHE_DIR` picks the folder (default: `$XDG_CACHE_HOME/fx2xla` or `~/.cache/fx2xla`);
`FX2XLA_CACHE_DIR=""` turns the disk cache off. An entry's name is a hash of everything that
changes the executable (module fingerprint, compile options, jaxlib version, platform and its
version, device kind, XLA_FLAGS); its header repeats those facts and a checksum of the payload, so a
truncated or corrupted entry, or one from another jaxlib or device, is never loaded. Writes go
to a temporary file first and are renamed into place, so concurrent writers never see each
other's partial files.
"""
from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import warnings
from dataclasses import dataclass

_MAGIC = b"FX2XLA-EXE\x01\n"
_SUFFIX = ".xla"


def default_cache_dir() -> str | None:
    if "FX2XLA_CACHE_DIR" in os.environ:
        return os.environ["FX2XLA_CACHE_DIR"] or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fx2xla")


def write_atomically(path: str, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file in its folder, renamed into place, so a
    reader (another process too) sees the old file or the new one, never part of one. Raises
    OSError."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.splitext(path)[1])
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@dataclass
class DiskStats:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    dropped: int = 0  # corrupt or foreign entries removed
    load_seconds: float = 0.0


class DiskCache:
    """`get(key, deserialize)` / `put(key, blob)` over one folder; `key` is a tuple of strings
    naming everything the executable depends on (see module doc)."""

    def __init__(self, folder: str):
        self.folder = folder
        self.stats = DiskStats()

    def path(self, key: tuple) -> str:
        digest = hashlib.sha256("\x00".join(map(str, key)).encode()).hexdigest()
        return os.path.join(self.folder, digest + _SUFFIX)

    @staticmethod
    def _header(key: tuple) -> bytes:
        return "\x00".join(map(str, key)).encode()

    def get(self, key: tuple) -> bytes | None:
        """The serialized executable for `key`, or None (absent, or dropped as invalid)."""
        p = self.path(key)
        try:
            with open(p, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        except OSError as e:
            warnings.warn(f"fx2xla: cannot read cache entry {p}: {e}; compiling instead")
            self.stats.misses += 1
            return None
        blob = self._parse(data, key)
        if blob is None:
            self.drop(p, "truncated, corrupted or written for another jaxlib/device")
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return blob

    def _parse(self, data: bytes, key: tuple) -> bytes | None:
        header = self._header(key)
        fixed = len(_MAGIC) + 4
        if len(data) < fixed or not data.startswith(_MAGIC):
            return None
        (hlen,) = struct.unpack_from("<I", data, len(_MAGIC))
        pos = fixed + hlen
        if data[fixed:pos] != header or len(data) < pos + 40:
            return None
        digest, (plen,) = data[pos:pos + 32], struct.unpack_from("<Q", data, pos + 32)
        payload = data[pos + 40:]
        if len(payload) != plen or hashlib.sha256(payload).digest() != digest:
            return None
        return payload

    def put(self, key: tuple, blob: bytes) -> None:
        header = self._header(key)
        data = b"".join([
            _MAGIC, struct.pack("<I", len(header)), header,
            hashlib.sha256(blob).digest(), struct.pack("<Q", len(blob)), blob,
        ])
        try:
            write_atomically(self.path(key), data)
        except OSError as e:
            warnings.warn(f"fx2xla: cannot write the executable cache in {self.folder}: {e}")
            return
        self.stats.writes += 1

    def drop(self, path: str, why: str) -> None:
        warnings.warn(f"fx2xla: dropping cache entry {path} ({why}); it will be recompiled")
        self.stats.dropped += 1
        try:
            os.unlink(path)
        except OSError:
            pass

    def entries(self) -> list[str]:
        if not os.path.isdir(self.folder):
            return []
        return sorted(os.path.join(self.folder, n) for n in os.listdir(self.folder) if n.endswith(_SUFFIX) and not n.startswith("."))

    def clear(self) -> int:
        n = 0
        for p in self.entries():
            try:
                os.unlink(p)
                n += 1
            except OSError:
                pass
        return n
