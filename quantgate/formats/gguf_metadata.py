"""Add key/values to a GGUF that llama.cpp has already written, its tensor data copied byte for byte.

llama.cpp's quantizer copies the source's metadata and takes overrides only through a C++ vector its C API cannot
build from Python, so what quantgate wants to record in a file it had llama.cpp write (the allocator's type map)
goes in afterwards. gguf-py's `GGUFReader` parses every element of every array into numpy objects: about 30 s for
the 248K-token vocabulary and merges of a Qwen3.5 file, longer than the allocation it follows. So this walks the
header by hand (written here because no library splices a GGUF header; gguf-py's `gguf_new_metadata.py` re-reads
and re-writes every value): each key's byte span is found by reading lengths only, the spans kept are copied
verbatim, the new keys are packed after them (the GGUF v2/v3 layout: key string, u32 type, value), the tensor
table is copied verbatim, and the data section follows at the file's alignment. The tensor offsets are relative
to the data section and depend only on the tensors' sizes and the alignment, so they are the same in both files;
the test reads the result back with gguf-py. The data is copied in chunks so no mapped page of a multi-GB file
stays resident, by `os.copy_file_range` where the system has it (the kernel moves the bytes, no copy through this
process) and in chunks where it does not.
"""
from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

from gguf import GGUFValueType

from ..errors import QuantgateError

COPY_CHUNK = 64 << 20  # bytes of tensor data per read/write
DEFAULT_ALIGNMENT = 32  # GGUF's, where a file does not say
# the fixed-size scalar value types and their struct codes
SCALAR = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
          GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
          GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}


class _Header:
    """A cursor over a GGUF's header bytes, in the file's byte order."""

    def __init__(self, buf: bytes, order: str):
        self.buf, self.order, self.pos = buf, order, 0

    def take(self, code: str):
        v = struct.unpack_from(self.order + code, self.buf, self.pos)[0]
        self.pos += struct.calcsize(code)
        return v

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return self.buf[self.pos - n:self.pos].decode("utf-8")

    def skip_value(self, vtype: int) -> None:
        if vtype == GGUFValueType.STRING:
            n = self.take("Q")
            self.pos += n
        elif vtype == GGUFValueType.ARRAY:
            sub, count = self.take("I"), self.take("Q")
            if sub in SCALAR:
                self.pos += count * struct.calcsize(SCALAR[GGUFValueType(sub)])
            else:
                for _ in range(count):
                    self.skip_value(sub)
        else:
            self.pos += struct.calcsize(SCALAR[GGUFValueType(vtype)])


def _pack_string(s: str, order: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack(order + "Q", len(b)) + b


def _pack_kv(key: str, v, order: str) -> bytes:
    """One key/value in GGUF's layout: str, int (int64), float (float32), bool, or a non-empty list of str."""
    head = _pack_string(key, order)
    if isinstance(v, bool):
        return head + struct.pack(order + "I?", GGUFValueType.BOOL, v)
    if isinstance(v, int):
        return head + struct.pack(order + "Iq", GGUFValueType.INT64, v)
    if isinstance(v, float):
        return head + struct.pack(order + "If", GGUFValueType.FLOAT32, v)
    if isinstance(v, str):
        return head + struct.pack(order + "I", GGUFValueType.STRING) + _pack_string(v, order)
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v):
        return (head + struct.pack(order + "IIQ", GGUFValueType.ARRAY, GGUFValueType.STRING, len(v))
                + b"".join(_pack_string(x, order) for x in v))
    raise QuantgateError(f"cannot store {type(v).__name__} in GGUF metadata")


def _read_header(f, src: Path) -> tuple[bytes, str, int]:
    """The fixed part of the header (24 bytes), its byte order and the tensor count; a file that is not GGUF v2+ is
    one error."""
    first = f.read(24)
    if len(first) < 24 or first[:4] != b"GGUF":
        raise QuantgateError(f"{src}: not a GGUF file")
    order = "<" if struct.unpack_from("<I", first, 4)[0] < 0x10000 else ">"
    version, n_tensors = struct.unpack_from(order + "IQ", first, 4)
    if version < 2:
        raise QuantgateError(f"{src}: GGUF version {version} is older than this writer reads")
    return first, order, n_tensors


def _parse(f, src: Path):
    """Walk the header, reading more of the file until it holds every key and the tensor table: (byte order, tensor
    count, the header's bytes, [(key, start, end)], the tensor table's span, alignment)."""
    size, chunk = os.fstat(f.fileno()).st_size, 1 << 20
    first, order, n_tensors = _read_header(f, src)
    buf = first
    while True:
        try:
            h = _Header(buf, order)
            h.pos = 24
            n_kv = struct.unpack_from(order + "Q", buf, 16)[0]
            spans, align = [], DEFAULT_ALIGNMENT
            for _ in range(n_kv):
                start = h.pos
                key, vtype = h.string(), h.take("I")
                if key == "general.alignment" and vtype == GGUFValueType.UINT32:
                    align = struct.unpack_from(order + "I", buf, h.pos)[0]
                h.skip_value(vtype)
                spans.append((key, start, h.pos))
            table = h.pos
            for _ in range(n_tensors):
                h.string()
                n_dims = h.take("I")
                h.pos += 8 * n_dims + 4 + 8
            if h.pos > len(buf):
                raise struct.error("past the end")
            return order, n_tensors, buf, spans, (table, h.pos), align
        except (struct.error, UnicodeDecodeError, ValueError, IndexError):
            if len(buf) >= size:
                raise QuantgateError(f"{src}: GGUF header is truncated or corrupt") from None
            buf += f.read(chunk)
            chunk *= 2


def copy_with_metadata(src: str | Path, dst: str | Path, extra: dict) -> None:
    """Write `dst`: `src` with the keys of `extra` (str, int, float, bool or a list of str) added, or replaced where
    `src` has them. `dst` is a path the caller owns (an atomic_path) and removes on failure."""
    src, dst = Path(src), Path(dst)
    with open(src, "rb") as fin:
        order, n_tensors, buf, spans, (t0, t1), align = _parse(fin, src)
        kept = [buf[a:b] for k, a, b in spans if k not in extra]
        added = [_pack_kv(k, v, order) for k, v in extra.items()]
        data_start = -(-t1 // align) * align  # the source's data section
        with open(dst, "wb") as out:
            out.write(buf[:8] + struct.pack(order + "QQ", n_tensors, len(kept) + len(added)))
            out.write(b"".join(kept) + b"".join(added) + buf[t0:t1])
            out.write(b"\0" * (-out.tell() % align))  # the data section starts aligned, as in every GGUF
            copy_tail(fin, data_start, out)


def copy_tail(fin, start: int, out) -> None:
    """Append `fin`'s bytes from `start` to its end at `out`'s position: in the kernel (os.copy_file_range) where the
    system offers it, else (another OS, or a file system that refuses it) in COPY_CHUNK reads and writes."""
    out.flush()
    pos, end = out.tell(), os.fstat(fin.fileno()).st_size
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while start + done < end:
                n = os.copy_file_range(fin.fileno(), out.fileno(), end - start - done, start + done, pos + done)
                if n == 0:
                    break
                done += n
        except OSError:  # EXDEV, ENOSYS, EINVAL...: what is copied stays, the rest goes by chunks
            pass
    fin.seek(start + done)
    out.seek(pos + done)
    shutil.copyfileobj(fin, out, COPY_CHUNK)
