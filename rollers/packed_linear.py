"""Linear layers with prepacked weights for small-batch CPU decoding (the torch engine's decode forwards).

A decode step multiplies a few rows (one per running slot) by every weight matrix of the model. For a
handful of rows, a plain fp32 ``F.linear`` on CPU (MKL ``sgemm``) repacks the weight into its blocked
layout on every call, so it moves each weight through memory about twice; oneDNN's inner-product with the
weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the weight
prepacking inductor's ``freezing`` does for CPU) reads it once. On this project's 2-core AVX-512 machine
(SmolLM2-135M's 211 linear layers per forward, 2 threads) a forward's linears take, plain → packed: 4 rows
39 → 30 ms, 8 rows 51 → 36 ms, 16 rows 54 → 45 ms, 32 rows 61 → 58 ms; at 1-3 rows the plain kernel is a
matrix-vector product already at memory bandwidth and faster (24 → 34 ms), and from ~48 rows (prefill)
plain wins again. At one thread (a roller's share in the asynchronous modes) packing gains more: 4 rows
76 → 50 ms, 8 rows 105 → 60 ms, 32 rows 128 → 107 ms, 1-3 rows ~45 ms either way. So ``PackedLinear``
takes the packed path for ``PACKED_ROWS[torch.float32]`` rows only.

bfloat16 (``model.compute_dtype=bfloat16``: the rollers hold the model in it) gains at every row count: oneDNN's
packed bf16 inner-product against ``F.linear``'s bf16 kernel, the same 211 linears, measured on this project's
2-core Sapphire Rapids VM (AMX, ``avx512_bf16``; 2026-12-03): one thread, 1-16 rows 37-42 → 30-31 ms, 48 rows
53 → 38, 256 rows 87 → 59; two threads, 8 rows 23 → 17 ms, 256 rows 58 → 43; results bit-identical in the
check made. So bf16 takes it for ``PACKED_ROWS[torch.bfloat16]`` (1-256 rows, the range measured), on CPUs
whose oneDNN runs bf16 (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: AVX-512 BW/VL/DQ or AVX-NE-CONVERT;
elsewhere oneDNN refuses to pack a bf16 weight, e.g. on an AVX2-only AMD EPYC, and bf16 takes ``F.linear``).
Not measured on a CPU without AMX.

The packed copy is made lazily and kept alongside the parameter (memory: one more copy of every linear
weight, tied output embedding included); it is rebuilt whenever the parameter changes in place (its
version counter: ``copy_`` by a weight load, as ``TorchEngine.load_weights`` does) or is replaced (another
parameter or storage); an in-place write through ``weight.data``, which bypasses that counter, is not seen.
Results equal ``F.linear`` to fp32 rounding (~1e-6 relative: another summation order), not bit for bit.

Only inference takes the packed path: with autograd recording (grad enabled and a parameter that
requires grad), or on another device or dtype than CPU fp32 or bf16, ``PackedLinear`` is exactly ``nn.Linear``.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn


def _measured_rows() -> dict[torch.dtype, range]:
    rows = {torch.float32: range(4, 33)}
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        rows[torch.bfloat16] = range(1, 257)
    return rows


PACKED_ROWS = _measured_rows()
"""Per dtype, the input rows (all leading dims together) that take the packed kernel (measured above); no
bf16 entry where this CPU's oneDNN has no bf16 kernels."""
_PACK_FOR_ROWS = 8  # the row count oneDNN chooses the blocked layout for (4-32 rows ran alike with 8 or 16)


def packing_available() -> bool:
    """Whether this torch build has oneDNN (``torch.backends.mkldnn``) for the packed kernel."""
    return torch.backends.mkldnn.is_available()


class PackedLinear(nn.Linear):
    """``nn.Linear`` sharing another one's ``weight``/``bias`` parameters (same objects, so ``state_dict``
    names, tying and in-place loads are unchanged) that multiplies CPU fp32/bf16 inputs of ``PACKED_ROWS`` rows
    by a prepacked copy of the weight when no gradient is recorded.

    ``forward(x)``: ``x`` ``(..., in_features)`` → ``(..., out_features)``, as ``nn.Linear``.
    """

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)  # no new parameters: take the given layer's
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._packed: torch.Tensor | None = None
        self._packed_from: tuple | None = None  # (weakref, data_ptr, version) of the weight it was packed from

    def _packed_weight(self) -> torch.Tensor:
        weight = self.weight
        if (
            self._packed is None
            or self._packed_from[0]() is not weight
            or self._packed_from[1:] != (weight.data_ptr(), weight._version)
        ):
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_FOR_ROWS)
            self._packed_from = (weakref.ref(weight), weight.data_ptr(), weight._version)
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            x.device.type == "cpu"
            and x.dtype == weight.dtype
            and weight.device.type == "cpu"
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
            and x.numel() // max(self.in_features, 1) in PACKED_ROWS.get(x.dtype, ())
        ):
            bias = None if self.bias is None else self.bias.detach()
            return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), bias, "none", [], "")
        return F.linear(x, weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` (exactly that type, so a second call replaces nothing) by a
    ``PackedLinear`` sharing its parameters, in place; returns how many were replaced (0 without oneDNN,
    when nothing is changed)."""
    if not packing_available():
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
