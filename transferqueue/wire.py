"""Wire format: one msgpack header frame, then one raw frame per tensor. No pickle, ever.

A request is ``[header, *frames]`` on a DEALER socket (the ROUTER prepends the peer identity); a reply is
``[header, *frames]``. Headers are msgpack maps with ``op`` (request) or ``ok`` (reply) and the request id
``rid`` that the client matches replies against (a late reply to an abandoned request is dropped).

A tensor travels as a *column*: the values of one field for a run of samples. Its descriptor is
``{"name", "dtype", "shape" (per-sample, fixed) | "shapes" (one per sample), "nbytes"}``; its bytes are
the samples back to back (row-major, each sample contiguous) in one frame (fixed shape, or a packed
variable-length column) or one frame per sample (``"split": True``). ``object`` columns hold msgpack
encodings of Python values, one per sample, ``shapes`` giving each encoding's byte length.

Every descriptor is validated against its frames (``validate_column``) before anything is stored.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from common.dtypes import DTYPE_NAMES, DTYPES
from transferqueue.records import LimitExceeded, RemoteError

MAX_HEADER_BYTES = 16 * 1024 * 1024
OBJECT_DTYPE = "object"


ITEMSIZE: dict[str, int] = {k: v.itemsize for k, v in DTYPES.items()}
_LIST, _INT = frozenset({list}), frozenset({int})


class WireError(RemoteError):
    """A message does not match the wire format (bad msgpack, frame count, dtype, shape, byte length)."""


def pack(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(frame, max_bytes: int = MAX_HEADER_BYTES) -> dict:
    """Decode a header frame; raises WireError for oversized, undecodable or non-map headers."""
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    if len(buf) > max_bytes:
        raise WireError(f"header of {len(buf)} bytes exceeds the {max_bytes}-byte limit")
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=False, max_bin_len=max_bytes,
                                 max_str_len=max_bytes, max_array_len=max_bytes, max_map_len=max_bytes)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise WireError(f"header must be a msgpack map, got {type(header).__name__}")
    return header


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype; raises TypeError for dtypes the wire does not carry (quantized)."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported by the TransferQueue wire format") from None


def _numpy_dtypes() -> frozenset:
    import warnings

    out = set()
    with warnings.catch_warnings():  # complex32 warns that it is experimental
        warnings.simplefilter("ignore", UserWarning)
        for d in DTYPES.values():
            try:
                torch.zeros(1, dtype=d).numpy()
                out.add(d)
            except TypeError:  # bfloat16, float8, complex32: numpy has no such dtype
                pass
    return frozenset(out)


NUMPY_DTYPES = _numpy_dtypes()


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    if t.dtype in NUMPY_DTYPES:  # fewer torch calls: this runs per field of every put
        return t.numpy().reshape(-1).view(np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def _check_shape(shape: Any, name: str) -> list[int]:
    if isinstance(shape, list | tuple):
        for d in shape:
            if not isinstance(d, int) or d < 0:
                break
        else:
            return list(shape)
    raise WireError(f"field {name!r}: shape must be a list of non-negative ints, got {shape!r}")


def _check_shapes(shapes: list, name: str) -> list[list[int]]:
    """``[_check_shape(s, name) for s in shapes]``; lists of plain ints are checked in bulk (one put can
    carry thousands of shapes), anything else per shape, so the error names the first bad one."""
    if set(map(type, shapes)) <= _LIST:
        dims = list(itertools.chain.from_iterable(shapes))
        if set(map(type, dims)) <= _INT and (not dims or min(dims) >= 0):
            return list(map(list, shapes))
    return [_check_shape(s, name) for s in shapes]


def row_nbytes(desc: dict) -> list[int]:
    """Byte length of each sample of a validated column descriptor."""
    if desc["dtype"] == OBJECT_DTYPE:
        return [s[0] for s in desc["shapes"]]
    item = ITEMSIZE[desc["dtype"]]
    if "shape" in desc:
        return [math.prod(desc["shape"]) * item] * desc["count"]
    return [math.prod(s) * item for s in desc["shapes"]]


def validate_column(desc: Any, count: int, max_name_chars: int = 1024) -> dict:
    """Check one column descriptor for ``count`` samples; returns it normalised (``count`` added).

    Raises WireError naming the field for: non-map descriptor, a name longer than ``max_name_chars``
    (``transferqueue.max_name_chars``), missing/unknown dtype, bad shape(s), a shapes list whose length
    is not ``count``, or ``nbytes`` that disagrees with dtype and shapes.
    """
    if not isinstance(desc, dict) or not isinstance(desc.get("name"), str):
        raise WireError(f"column descriptor must be a map with a string name, got {desc!r:.200}")
    name, dtype = desc["name"], desc.get("dtype")
    if len(name) > max_name_chars:
        raise WireError(f"field {name:.64}...: a name of {len(name)} characters, past "
                        f"transferqueue.max_name_chars={max_name_chars}")
    if dtype != OBJECT_DTYPE and dtype not in ITEMSIZE:
        raise WireError(f"field {name!r}: unknown dtype {dtype!r}")
    if ("shape" in desc) == ("shapes" in desc):
        raise WireError(f"field {name!r}: exactly one of shape / shapes is required")
    if "shape" in desc:
        if dtype == OBJECT_DTYPE:
            raise WireError(f"field {name!r}: object columns need per-sample shapes")
        shape = _check_shape(desc["shape"], name)
        out = {"name": name, "dtype": dtype, "shape": shape}
        total = math.prod(shape) * ITEMSIZE[dtype] * count  # sum(row_nbytes(out)) without the list
    else:
        shapes = desc["shapes"]
        if not isinstance(shapes, list) or len(shapes) != count:
            raise WireError(f"field {name!r}: shapes must be a list of {count} shapes")
        out = {"name": name, "dtype": dtype, "shapes": _check_shapes(shapes, name)}
        if dtype == OBJECT_DTYPE and not all(len(s) == 1 for s in out["shapes"]):
            raise WireError(f"field {name!r}: object shapes must be [byte_length]")
        total = sum(map(math.prod, out["shapes"])) * ITEMSIZE.get(dtype, 1)  # object: byte lengths
    out["count"] = count
    out["split"] = bool(desc.get("split", False))
    if desc.get("nbytes") != total:
        raise WireError(f"field {name!r}: nbytes {desc.get('nbytes')!r} != {total} implied by dtype and shape")
    out["nbytes"] = total
    return out


def validate_frames(columns: list[dict], frames: Sequence) -> None:
    """Check that ``frames`` carry exactly the bytes ``columns`` describe; raises WireError if not."""
    expected = sum(c["count"] if c["split"] else 1 for c in columns)
    if len(frames) != expected:
        raise WireError(f"expected {expected} data frames for {len(columns)} columns, got {len(frames)}")
    pos = 0
    for col in columns:
        sizes = row_nbytes(col) if col["split"] else [col["nbytes"]]
        for size in sizes:
            got = len(frames[pos].buffer if hasattr(frames[pos], "buffer") else frames[pos])
            if got != size:
                raise WireError(f"field {col['name']!r}: frame of {got} bytes, header says {size}")
            pos += 1


# ----------------------------------------------------------------------------------- client encoding


def encode_column(name: str, value: Any, count: int) -> tuple[dict, list]:
    """Describe one field's values for ``count`` samples; returns ``(descriptor, buffers)``.

    ``value``: a tensor ``(count, *shape)`` (one buffer, no copy when contiguous), a list of ``count``
    tensors (variable shapes; one buffer per sample, ``split``), or a list of ``count`` msgpack-able
    objects (``object`` column, one packed buffer). Raises ValueError/TypeError for a wrong batch size,
    CUDA tensors, or values msgpack cannot encode.
    """
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"field {name!r}: CPU tensors only on this path, got {value.device}")
        if value.dim() == 0 or value.shape[0] != count:
            raise ValueError(f"field {name!r}: expected batch-first tensor with {count} rows, got {tuple(value.shape)}")
        t = value.contiguous()
        desc = {"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape[1:]), "nbytes": t.nbytes}
        return desc, [tensor_bytes(t)]
    if not isinstance(value, list | tuple) or len(value) != count:
        raise ValueError(f"field {name!r}: expected a tensor or a list of {count} values, got {type(value).__name__}")
    if count and all(isinstance(v, torch.Tensor) for v in value):
        dtypes = {v.dtype for v in value}
        if len(dtypes) != 1:
            raise TypeError(f"field {name!r}: samples have different dtypes {sorted(map(str, dtypes))}")
        parts = [v.contiguous() for v in value]
        for v in parts:
            if v.device.type != "cpu":
                raise ValueError(f"field {name!r}: CPU tensors only on this path, got {v.device}")
        desc = {"name": name, "dtype": dtype_name(parts[0].dtype), "shapes": [list(v.shape) for v in parts],
                "nbytes": sum(v.nbytes for v in parts), "split": True}
        return desc, [tensor_bytes(v) for v in parts]
    try:
        blobs = [msgpack.packb(v, use_bin_type=True) for v in value]
    except TypeError as exc:
        raise TypeError(f"field {name!r}: values must be tensors or msgpack-able objects: {exc}") from None
    desc = {"name": name, "dtype": OBJECT_DTYPE, "shapes": [[len(b)] for b in blobs],
            "nbytes": sum(len(b) for b in blobs)}
    return desc, [b"".join(blobs)]


def batch_size(data: dict) -> int:
    """The number of samples in a put's fields (each a tensor with a leading batch dim, or a list);
    raises ValueError for no fields or fields of different lengths."""
    if not data:
        raise ValueError("put needs at least one field")
    sizes = {name: (v.shape[0] if isinstance(v, torch.Tensor) and v.dim() else len(v)) for name, v in data.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"fields have different batch sizes: {sizes}")
    return next(iter(sizes.values()))


def rows(value: Any, pos: np.ndarray) -> Any:
    """Rows ``pos`` (sorted, distinct) of a field value: the value itself or a view for a contiguous
    range, else a gathered copy."""
    if len(pos) == len(value):
        return value
    if len(pos) and pos[-1] - pos[0] == len(pos) - 1:
        return value[int(pos[0]):int(pos[-1]) + 1]
    if isinstance(value, torch.Tensor):
        return value.index_select(0, torch.from_numpy(pos))
    return [value[i] for i in pos.tolist()]


def index_columns(data: dict, names: Sequence[str], count: int) -> list[dict]:
    """The column descriptors the index keeps for a put of ``count`` samples (no ``split`` flag: how
    the bytes travelled is the unit's business)."""
    cols = []
    for n in names:
        v = data[n]
        if isinstance(v, torch.Tensor):
            cols.append({"name": n, "dtype": dtype_name(v.dtype), "shape": list(v.shape[1:]), "nbytes": v.nbytes})
        else:
            desc, _ = encode_column(n, v, count)
            desc.pop("split", None)
            cols.append(desc)
    return cols


def decode_column(desc: dict, out: np.ndarray) -> Any:
    """Turn a filled uint8 buffer ``out`` of a column into the user-facing value (see ``Batch``). Raises
    WireError when an ``object`` row is not exactly one msgpack value."""
    rows = row_nbytes(desc)
    if desc["dtype"] == OBJECT_DTYPE:
        res, pos = [], 0
        raw = out.tobytes()
        for i, n in enumerate(rows):
            try:
                res.append(msgpack.unpackb(raw[pos:pos + n], raw=False, strict_map_key=False))
            except Exception as exc:  # msgpack raises several unrelated types (ExtraData, ValueError, ...)
                raise WireError(f"field {desc['name']!r}: row {i} is not one msgpack value: "
                                f"{type(exc).__name__}: {exc}") from None
            pos += n
        return res
    dtype = DTYPES[desc["dtype"]]
    if isinstance(out, torch.Tensor):  # p2p: already on the client's device
        flat = out.view(dtype) if out.numel() else torch.empty(0, dtype=dtype, device=out.device)
    else:
        flat = torch.from_numpy(out).view(dtype) if out.size else torch.empty(0, dtype=dtype)
    if "shape" in desc:
        return flat.view(desc["count"], *desc["shape"])
    res, pos, item = [], 0, ITEMSIZE[desc["dtype"]]
    for shape, n in zip(desc["shapes"], rows, strict=True):
        res.append(flat[pos // item:(pos + n) // item].view(*shape))
        pos += n
    return res


# ------------------------------------------------------------------------------------------- sample ids


MAX_ID = (1 << 63) - 1


def id_range(value) -> int | None:
    """The first id when ``value`` (a request's ``ids``) lists consecutive non-negative ints, else None."""
    if not isinstance(value, list) or not value or not all(type(v) is int for v in value):
        return None
    lo = value[0]
    if lo < 0 or lo + len(value) > MAX_ID + 1:
        return None
    return lo if value == list(range(lo, lo + len(value))) else None


def as_ids(value, what: str = "ids") -> np.ndarray:
    """A request's id list as an int64 array; raises WireError unless it is a list of non-negative ints."""
    if not isinstance(value, list) or not all(type(v) is int and 0 <= v <= MAX_ID for v in value):
        raise WireError(f"{what} must be a list of non-negative ints (below 2**63)")
    return np.asarray(value, dtype=np.int64) if value else np.zeros(0, dtype=np.int64)


def check_id_count(what: str, n: int, limit: int) -> None:
    """Raise LimitExceeded (a ValueError), naming the bound, when one request names or allocates more than
    ``limit`` ids (``transferqueue.max_request_ids``)."""
    if n > limit:
        raise LimitExceeded("max_request_ids", f"{what}: {n} ids in one request, past "
                            f"transferqueue.max_request_ids={limit} (split the request)")
