"""vLLM release files from the package index pip is configured with: the sdist's tests, and the
Python source of a wheel without downloading the wheel.

A vLLM wheel is 250-400 MB, almost all of it compiled kernels; its ``.py`` and ``.json``
members are ~15 MB.  :func:`extract_wheel_sources` reads the zip's central directory with an
HTTP range request, then fetches only the byte ranges that hold those members (neighbouring
members coalesced into one request) and inflates them -- 30-60x less to transfer than
``pip download``, which is what the version-matrix tests and the upstream gate need on a fresh
CI machine.  Every member is checked against the CRC-32 its central directory records; where
the index does not serve byte ranges, the whole wheel is downloaded instead and checked against
the index's sha256.
"""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import urllib.request
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

JSON_API = "application/vnd.pypi.simple.v1+json"
EOCD_SIG, CDIR_SIG, LOCAL_SIG = b"PK\x05\x06", b"PK\x01\x02", b"PK\x03\x04"
ZIP64_EOCD_LOC_SIG, ZIP64_EOCD_SIG = b"PK\x06\x07", b"PK\x06\x06"
TAIL = 1 << 16
GAP = 1 << 20          # members closer than this share one request


def index_url() -> str:
    """The index pip uses here (its configured index-url, else pip's own default)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                          capture_output=True, text=True)
    url = proc.stdout.strip() if proc.returncode == 0 else ""
    if not url:
        from pip._internal.models.index import PyPI

        url = PyPI.simple_url
    return url.rstrip("/")


def release_file(project: str, accept: Callable[[str], bool]) -> tuple[str, str, str]:
    """(filename, url, sha256) of the first file of ``project`` whose name ``accept``s."""
    req = urllib.request.Request(f"{index_url()}/{project}/", headers={"Accept": JSON_API})
    with urllib.request.urlopen(req, timeout=120) as resp:
        listing = json.load(resp)
    for entry in listing.get("files", []):
        if accept(entry.get("filename", "")):
            return entry["filename"], entry["url"], entry["hashes"]["sha256"]
    raise LookupError(f"the package index lists no matching file of {project}")


def download(url: str, dest: Path, sha256: str) -> Path:
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=900) as resp, dest.open("wb") as out:
        while chunk := resp.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != sha256:
        raise RuntimeError(f"{dest.name}: sha256 {digest.hexdigest()} is not the index's "
                           f"{sha256}")
    return dest


# ------------------------------------------------------------------------- wheel members


class RangesRefused(RuntimeError):
    """The server answered a range request with the whole file."""


def _get(url: str, start: int, end: int | None = None) -> bytes:
    """Bytes ``[start, end)`` of ``url``; ``start < 0``: the last ``-start`` bytes."""
    spec = f"bytes={start}" if start < 0 else f"bytes={start}-{'' if end is None else end - 1}"
    req = urllib.request.Request(url, headers={"Range": spec})
    with urllib.request.urlopen(req, timeout=300) as resp:
        if resp.status != 206:
            raise RangesRefused(f"{url}: status {resp.status} to a range request")
        return resp.read()


@dataclass(frozen=True)
class Member:
    name: str
    method: int            # 0 stored, 8 deflated
    crc: int
    size: int              # compressed
    offset: int            # of its local header


def _central_directory(url: str) -> list[Member]:
    tail = _get(url, -TAIL)
    at = tail.rfind(EOCD_SIG)
    if at < 0:
        raise RuntimeError(f"{url}: no zip end-of-central-directory record in the last "
                           f"{TAIL} bytes")
    cd_size, cd_offset = struct.unpack("<II", tail[at + 12:at + 20])
    if cd_offset == 0xFFFFFFFF or cd_size == 0xFFFFFFFF:      # zip64
        loc = tail.rfind(ZIP64_EOCD_LOC_SIG, 0, at)
        (eocd64,) = struct.unpack("<Q", tail[loc + 8:loc + 16])
        rec = _get(url, eocd64, eocd64 + 56)
        if rec[:4] != ZIP64_EOCD_SIG:
            raise RuntimeError(f"{url}: bad zip64 end-of-central-directory record")
        cd_size, cd_offset = struct.unpack("<QQ", rec[40:56])
    data = _get(url, cd_offset, cd_offset + cd_size)
    members, pos = [], 0
    while pos < len(data) and data[pos:pos + 4] == CDIR_SIG:
        method, = struct.unpack("<H", data[pos + 10:pos + 12])
        crc, csize, usize = struct.unpack("<III", data[pos + 16:pos + 28])
        nlen, elen, clen = struct.unpack("<HHH", data[pos + 28:pos + 34])
        offset, = struct.unpack("<I", data[pos + 42:pos + 46])
        name = data[pos + 46:pos + 46 + nlen].decode()
        extra = data[pos + 46 + nlen:pos + 46 + nlen + elen]
        if 0xFFFFFFFF in (csize, usize, offset):
            csize, offset = _zip64_sizes(extra, usize, csize, offset)
        members.append(Member(name, method, crc, csize, offset))
        pos += 46 + nlen + elen + clen
    return members


def _zip64_sizes(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int]:
    """(compressed size, local header offset) from a member's zip64 extra field, which holds
    the 64-bit form of each 32-bit field that overflowed, in this order."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack("<HH", extra[pos:pos + 4])
        if tag == 1:
            values = iter(struct.unpack(f"<{size // 8}Q", extra[pos + 4:pos + 4 + size // 8 * 8]))
            if usize == 0xFFFFFFFF:
                next(values)
            if csize == 0xFFFFFFFF:
                csize = next(values)
            if offset == 0xFFFFFFFF:
                offset = next(values)
            return csize, offset
        pos += 4 + size
    raise RuntimeError("a member's zip64 sizes are missing")


def _spans(members: list[Member]) -> Iterable[tuple[int, int, list[Member]]]:
    """Coalesced byte ranges covering ``members`` (each with room for its local header)."""
    span: list[Member] = []
    start = end = 0
    for m in sorted(members, key=lambda m: m.offset):
        m_end = m.offset + 30 + len(m.name.encode()) + 1024 + m.size   # header, its extra
        if span and m.offset - end > GAP:
            yield start, end, span
            span = []
        if not span:
            start = m.offset
        span.append(m)
        end = max(end, m_end)
    if span:
        yield start, end, span


def _inflate(member: Member, blob: bytes, base: int) -> bytes:
    pos = member.offset - base
    if blob[pos:pos + 4] != LOCAL_SIG:
        raise RuntimeError(f"{member.name}: no local header at {member.offset}")
    nlen, elen = struct.unpack("<HH", blob[pos + 26:pos + 30])
    start = pos + 30 + nlen + elen
    raw = blob[start:start + member.size]
    if member.method == 0:
        data = raw
    elif member.method == 8:
        data = zlib.decompress(raw, -15)
    else:
        raise RuntimeError(f"{member.name}: compression method {member.method}")
    if zlib.crc32(data) != member.crc:
        raise RuntimeError(f"{member.name}: CRC-32 mismatch")
    return data


def extract_wheel_sources(url: str, dest: Path, wanted: Callable[[str], bool]) -> int:
    """Write the ``wanted`` members of the wheel at ``url`` under ``dest``; returns the bytes
    transferred.  Raises :class:`RangesRefused` where the server does not serve ranges."""
    members = [m for m in _central_directory(url) if wanted(m.name)]
    fetched = 0
    for start, end, span in _spans(members):
        end += 4096
        blob = _get(url, start, end)
        fetched += len(blob)
        for m in span:
            target = dest / m.name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(_inflate(m, blob, start))
    return fetched
