"""The one table of dtype names: wire names ⇄ torch dtypes, used by every package that spells a dtype.

``DTYPES`` maps torch's own spelling (``"bfloat16"``, the part after ``torch.``) to the dtype, for every
dtype a tensor may carry over a wire of this project (the TransferQueue format, the weight plane's
buckets, SGLang's ``dtypes`` lists). ``FLOAT_DTYPES`` are the dtypes a model's weights may be kept in
(``model.dtype``, ``checkpointengine.dtype``).
"""

from __future__ import annotations

import torch

_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
          "bfloat16", "float32", "float64", "complex32", "complex64", "complex128", "float8_e4m3fn",
          "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")

# Names this torch build has (older builds lack some float8 kinds and the unsigned ints).
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _NAMES
                                  if isinstance(getattr(torch, n, None), torch.dtype)}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of ``dtype`` (``torch.bfloat16`` → ``"bfloat16"``); raises TypeError for dtypes no wire
    carries (quantized ones)."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} has no wire name; supported: {sorted(DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of ``dtype_name`` (``"torch.bfloat16"``, as SGLang clients send it, is accepted too);
    raises ValueError naming an unknown dtype and the supported ones."""
    dtype = DTYPES.get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; supported: {sorted(DTYPES)}")
    return dtype
