"""Add key/values to a GGUF that llama.cpp has already written, its tensor data copied byte for byte.

llama.cpp's quantizer copies the source's metadata and takes overrides only through a C++ vector its C API cannot
build from Python, so what quantgate wants to record in a file it had llama.cpp write (the allocator's type map)
goes in afterwards: gguf-py's writer writes the header (every key of the file, then the new ones) and the tensor
table, and the data section is copied unchanged. The tensor offsets are relative to the data section and depend
only on the tensors' sizes and the alignment, so they are the same in both files; this is checked, not assumed.
gguf-py's `gguf_new_metadata.py` does the same through memory maps; this copies in chunks so no mapped page of a
multi-GB file stays resident, by `os.copy_file_range` where the system has it (the kernel moves the bytes, no
copy through this process) and in chunks where it does not.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter

from ..errors import QuantgateError

COPY_CHUNK = 64 << 20  # bytes of tensor data per read/write


def _value_type(v) -> tuple[GGUFValueType, GGUFValueType | None]:
    if isinstance(v, bool):
        return GGUFValueType.BOOL, None
    if isinstance(v, int):
        return GGUFValueType.INT64, None
    if isinstance(v, float):
        return GGUFValueType.FLOAT32, None
    if isinstance(v, str):
        return GGUFValueType.STRING, None
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v):
        return GGUFValueType.ARRAY, GGUFValueType.STRING
    raise QuantgateError(f"cannot store {type(v).__name__} in GGUF metadata")


def copy_with_metadata(src: str | Path, dst: str | Path, extra: dict) -> None:
    """Write `dst`: `src` with the keys of `extra` (str, int, float, bool or a list of str) added, or replaced where
    `src` has them. `dst` is a path the caller owns (an atomic_path) and removes on failure."""
    src, dst = Path(src), Path(dst)
    reader = GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    align = reader.fields.get("general.alignment")
    if align is not None:
        writer.data_alignment = int(align.contents())
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in extra:
            continue  # the header's own fields, written by the writer; and the keys being replaced
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), vtype, sub_type=sub)
    for name, value in extra.items():
        vtype, sub = _value_type(value)
        writer.add_key_value(name, list(value) if sub else value, vtype, sub_type=sub)
    first, offset = reader.data_offset, 0
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        if t.data_offset - first != offset:  # where gguf-py's writer will say it is
            raise QuantgateError(f"{src}: tensor {t.name} is not where the GGUF layout puts it; not rewritten")
        offset += GGUFWriter.ggml_pad(int(t.n_bytes), writer.data_alignment)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    out = writer.fout[0]
    writer.write_padding(out, out.tell())  # the data section starts aligned, as in every GGUF
    with open(src, "rb") as fin:
        copy_tail(fin, first, out)
    writer.close()
    del reader  # its memory map


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
