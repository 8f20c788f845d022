"""Shrink a CUDA library to one GPU architecture without relinking it.

vLLM's ``_C_stable_libtorch.abi3.so`` holds, in its ``.nv_fatbin`` section, one fat binary per
kernel translation unit with SASS for every supported architecture (and PTX).  Each fat binary
is rewritten in place to keep only the entries for ``arch`` (SASS, else the newest PTX not newer
than ``arch``, else its smallest entry as a placeholder) and zero-padded to its old size: every
offset the library holds stays valid, and the zeros compress to nothing.
"""

from __future__ import annotations

import struct

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_SASS = 1, 2


def _section(data: bytes, wanted: bytes) -> tuple[int, int]:
    """(offset, size) of the ELF64 section named ``wanted``."""
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    str_off = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)[0]
    for i in range(shnum):
        hdr = shoff + i * shentsize
        name_at = str_off + struct.unpack_from("<I", data, hdr)[0]
        name = data[name_at:data.index(b"\0", name_at)]
        if name == wanted:
            return struct.unpack_from("<QQ", data, hdr + 0x18)
    raise ValueError(f"no {wanted.decode()} section")


def prune(data: bytes, arch: int = 90) -> tuple[bytes, dict[str, int]]:
    out = bytearray(data)
    off, size = _section(data, b".nv_fatbin")
    stats = {"sass": 0, "ptx": 0, "placeholder": 0}
    pos, end_sec = off, off + size
    while pos < end_sec:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", out, pos)
        if magic != FATBIN_MAGIC:
            pos += 8
            continue
        ep, end = pos + hsz, pos + hsz + fsz
        entries = []
        while ep < end:
            kind, _ever, ehsz, psz = struct.unpack_from("<HHIQ", out, ep)
            entries.append((kind, struct.unpack_from("<I", out, ep + 28)[0], ehsz, psz, ep))
            ep += ehsz + psz
        keep = [e for e in entries if e[0] == KIND_SASS and e[1] == arch]
        if keep:
            stats["sass"] += 1
        elif ptx := [e for e in entries if e[0] == KIND_PTX and e[1] <= arch]:
            keep = [max(ptx, key=lambda e: e[1])]
            stats["ptx"] += 1
        else:
            keep = [min(entries, key=lambda e: e[3])]
            stats["placeholder"] += 1
        new = b"".join(bytes(out[e[4]:e[4] + e[2] + e[3]]) for e in keep)
        out[pos + hsz:end] = new + bytes(fsz - len(new))
        struct.pack_into("<Q", out, pos + 8, len(new))
        pos = end
    return bytes(out), stats
