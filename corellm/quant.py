"""Quantized weights: the block formats a linear layer may keep its weight in, and their reference
arithmetic in torch.

A quantized weight never becomes a float tensor in memory: its rows stay in the format's blocks
(a ``QuantizedTensor``: one uint8 row of blocks per output feature), and a platform multiplies
them directly (``DeviceOps.quantized_linear``; the CPU platform's C kernels dequantize in
registers). What is here is the definition every kernel is checked against: ``dequantize`` in
plain torch, on any device, the arithmetic of ggml's own dequantizers, so the reference op
(dequantize, then ``F.linear``) runs anywhere, slowly.

Formats:

* GGUF's, read from the file as they are (``model.quantization: gguf``): ``Q8_0``, ``Q4_0``,
  ``Q4_1`` (blocks of 32 values with an fp16 scale, and an fp16 offset for Q4_1) and the
  k-quants ``Q4_K``, ``Q5_K``, ``Q6_K`` (super-blocks of 256 values in sub-blocks of 32 or 16,
  each with its own 6- or 8-bit scale under the super-block's fp16 ones).
* ``int8``: weight-only per-output-channel int8 (``model.quantization: int8``), made at load
  from a float checkpoint: each row its int8 values and one float32 scale, ``amax / 127``.

Rows are independent, so a weight is split between tensor-parallel ranks by rows freely and by
columns at block boundaries.

Layouts, each the file's bytes reordered (``dequantize`` reads them all):

* ``gguf``: the file's, each block's scale bytes, then its values.
* ``grouped`` (the 32-value formats): each run of 8 blocks of a row stores the 8 blocks' scales
  together (and Q4_1's 8 offsets), then their values, so a kernel converts 8 scales with one
  instruction.
* ``interleaved`` (every GGUF format): the rows in groups of 8, each block of a group stored as
  the 8 rows' scales side by side, then their values four bytes at a time (the 8 rows' first
  four, the 8 rows' next four...), so one vector of bytes holds 4 values of 8 rows and a
  kernel multiplies it with 4 activations into 8 output columns at once (the layout of
  llama.cpp's repacked CPU kernels). The rows after the last whole group follow in the
  ``grouped`` layout (the k-quants: the file's). A row's bytes are spread over its group's
  ``data`` rows: ``rows`` and ``narrow`` gather them back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantFormat:
    """A block format: ``block`` values stored in ``type_size`` bytes."""

    name: str
    block: int
    type_size: int
    bits: float                 # bits per value, scales included

    def row_bytes(self, cols: int) -> int:
        return cols // self.block * self.type_size


def _fmt(name: str, block: int, type_size: int) -> QuantFormat:
    return QuantFormat(name, block, type_size, 8 * type_size / block)


#: Bytes of scale (and offset) at the head of a block, for the formats that may be ``grouped``.
GROUPABLE = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}
GROUP = 8
#: The formats that may be ``interleaved``, and the rows of a group.
INTERLEAVABLE = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
INTERLEAVE = 8
LAYOUTS = ("gguf", "grouped", "interleaved")

#: The GGUF formats kept quantized (the others dequantize at load).
GGUF_FORMATS: dict[str, QuantFormat] = {f.name: f for f in (
    _fmt("Q8_0", 32, 34), _fmt("Q4_0", 32, 18), _fmt("Q4_1", 32, 20),
    _fmt("Q4_K", 256, 144), _fmt("Q5_K", 256, 176), _fmt("Q6_K", 256, 210))}
INT8 = QuantFormat("int8", 1, 1, 8.0)           # + one float32 scale per row
FORMATS: dict[str, QuantFormat] = {**GGUF_FORMATS, "int8": INT8}


class QuantizedTensor:
    """A [rows, cols] weight in one format: ``data`` holds each row's blocks (uint8 [rows,
    row_bytes]; for ``int8`` the int8 values [rows, cols], with ``scale`` float32 [rows])."""

    def __init__(self, data: torch.Tensor, qtype: str, cols: int,
                 scale: torch.Tensor | None = None, layout: str = "gguf") -> None:
        self.format = FORMATS[qtype]
        self.qtype, self.data, self.cols, self.scale = qtype, data, int(cols), scale
        if layout not in LAYOUTS or (layout == "grouped" and qtype not in GROUPABLE) or (
                layout == "interleaved" and qtype not in INTERLEAVABLE):
            raise ValueError(f"no {layout!r} layout for {qtype}")
        self.layout = layout
        if data.dim() != 2:
            raise ValueError(f"{qtype} data must be 2-D (rows of blocks), got {data.dim()}-D")
        if qtype == "int8":
            if scale is None or data.shape[1] != cols or scale.shape != (data.shape[0],):
                raise ValueError("int8 data must be [rows, cols] with a float32 scale per row")
        elif cols % self.format.block or data.shape[1] != self.format.row_bytes(cols):
            raise ValueError(f"a {qtype} row of {cols} values is not whole {self.format.block}-"
                             f"value blocks of {self.format.type_size} bytes "
                             f"(got {data.shape[1]} bytes per row)")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), self.cols)

    @property
    def nbytes(self) -> int:
        scale = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.data.numel() * self.data.element_size() + scale

    def narrow(self, dim: int, start: int, size: int) -> QuantizedTensor:
        """Rows ``[start, start + size)`` (dim 0), or columns (dim 1) on block boundaries."""
        if dim == 0 and self.layout == "interleaved" and (
                start % INTERLEAVE or size % INTERLEAVE or start + size > self._whole):
            return self.ungrouped().narrow(dim, start, size)
        if dim == 0:
            scale = None if self.scale is None else self.scale.narrow(0, start, size)
            return QuantizedTensor(self.data.narrow(0, start, size), self.qtype, self.cols,
                                   scale, self.layout)
        if self.layout != "gguf":
            return self.ungrouped().narrow(dim, start, size)
        block = self.format.block
        if start % block or size % block:
            raise ValueError(f"columns {start}:{start + size} of a {self.qtype} weight do not "
                             f"fall on its {block}-value blocks (tensor parallelism splits a "
                             "row-parallel weight there; model.quantization: none dequantizes)")
        ts = self.format.type_size
        return QuantizedTensor(self.data.narrow(1, start // block * ts, size // block * ts),
                               self.qtype, size, self.scale)

    def contiguous(self) -> QuantizedTensor:
        """The same tensor with its rows in one contiguous buffer (what kernels read)."""
        if self.data.is_contiguous() and (self.scale is None or self.scale.is_contiguous()):
            return self
        scale = None if self.scale is None else self.scale.contiguous()
        return QuantizedTensor(self.data.contiguous(), self.qtype, self.cols, scale,
                               self.layout)

    def map_rows(self, fn) -> QuantizedTensor:
        """The same values with the rows reordered by ``fn`` (applied to the row-major data)."""
        if self.layout == "interleaved":
            return self.ungrouped().map_rows(fn)
        scale = None if self.scale is None else fn(self.scale.unsqueeze(1)).squeeze(1)
        return QuantizedTensor(fn(self.data), self.qtype, self.cols, scale, self.layout)

    @property
    def _whole(self) -> int:
        """The rows in whole groups of ``INTERLEAVE`` (what the interleaved layout reorders)."""
        return self.data.shape[0] - self.data.shape[0] % INTERLEAVE

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """Rows ``index`` (an interleaved tensor's come back in the file's layout: their bytes
        gathered from their groups, or ungrouped from the rows after them, whichever holds
        each; no value is read back to the host)."""
        if self.layout == "interleaved":
            n, rb, whole = self.data.shape[0], self.data.shape[1], self._whole
            # ids counted from the end as indexing counts them; an id outside [-n, n) made one
            # that indexing below refuses (IndexError), as it refuses it in the file's layout
            index = torch.where(index < 0, index + n, index)
            index = torch.where((index < 0) | (index >= n), n + INTERLEAVE * n, index)
            out = None
            if whole:
                flat = self.data[:whole].reshape(-1, INTERLEAVE * rb)
                inverse = _interleave_inverse(self.qtype, rb).to(flat.device)
                i = index.clamp(max=whole - 1) if whole < n else index
                out = flat[(i // INTERLEAVE).unsqueeze(-1), inverse[i % INTERLEAVE]]
            if whole < n:
                rest = _untail(self.data[whole:], self.qtype)[(index - whole).clamp(min=0)]
                out = rest if out is None else torch.where(
                    (index < whole).unsqueeze(-1), out, rest)
            return QuantizedTensor(out, self.qtype, self.cols)
        scale = None if self.scale is None else self.scale[index]
        return QuantizedTensor(self.data[index], self.qtype, self.cols, scale, self.layout)

    def grouped(self) -> QuantizedTensor:
        """This tensor in the ``grouped`` layout (a new buffer of the same size)."""
        if self.layout == "grouped":
            return self
        return QuantizedTensor(_regroup(self.ungrouped().data, self.qtype, group=True),
                               self.qtype, self.cols, layout="grouped")

    def interleaved(self) -> QuantizedTensor:
        """This tensor in the ``interleaved`` layout (a new buffer of the same size)."""
        if self.layout == "interleaved":
            return self
        data = self.ungrouped().data
        rb, whole = data.shape[1], self._whole
        index = _interleave_index(self.qtype, rb).to(data.device)
        parts = [data[:whole].reshape(-1, INTERLEAVE * rb)[:, index].view(-1, rb)]
        if whole < data.shape[0]:
            rest = data[whole:]
            parts.append(_regroup(rest, self.qtype, True) if self.qtype in GROUPABLE else rest)
        return QuantizedTensor(torch.cat(parts).contiguous(), self.qtype, self.cols,
                               layout="interleaved")

    def ungrouped(self) -> QuantizedTensor:
        """This tensor in the file's layout."""
        if self.layout == "gguf":
            return self
        if self.layout == "interleaved":
            rb, whole = self.data.shape[1], self._whole
            inverse = _interleave_inverse(self.qtype, rb).to(self.data.device).reshape(-1)
            groups = self.data[:whole].reshape(-1, INTERLEAVE * rb)[:, inverse].view(-1, rb)
            return QuantizedTensor(torch.cat([groups, _untail(self.data[whole:], self.qtype)]),
                                   self.qtype, self.cols)
        return QuantizedTensor(_regroup(self.data, self.qtype, group=False), self.qtype,
                               self.cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.qtype}, shape={list(self.shape)})"


class QuantizedWeight:
    """A linear layer's weight as one or more row ranges, each a ``QuantizedTensor`` (a merged
    projection whose parts came in different formats, e.g. a Q4_K_M file's Q4_K Q and K beside
    its Q6_K V, keeps each part in its own)."""

    def __init__(self, parts: list[tuple[int, QuantizedTensor]]) -> None:
        parts = sorted(((start, t.contiguous()) for start, t in parts), key=lambda p: p[0])
        merged: list[tuple[int, QuantizedTensor]] = []
        for start, t in parts:                    # adjacent parts of one format: one tensor
            if merged and merged[-1][1].qtype == t.qtype and t.qtype != "int8" and (
                    merged[-1][1].layout == t.layout
                    and merged[-1][0] + merged[-1][1].shape[0] == start
                    and (t.layout != "interleaved" or merged[-1][1].shape[0] % INTERLEAVE == 0
                         and t.shape[0] % INTERLEAVE == 0)):
                s0, prev = merged[-1]
                merged[-1] = (s0, QuantizedTensor(torch.cat([prev.data, t.data]), t.qtype,
                                                  t.cols, layout=t.layout))
            else:
                merged.append((start, t))
        self.parts = merged
        self.cols = merged[0][1].cols
        self.rows = merged[-1][0] + merged[-1][1].shape[0]

    @property
    def qtypes(self) -> tuple[str, ...]:
        return tuple(t.qtype for _, t in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([t.dequantize(dtype) for _, t in self.parts])

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` dequantized (an embedding lookup), shaped ``ids.shape + (cols,)``."""
        flat = ids.reshape(-1)
        if len(self.parts) == 1 and self.parts[0][0] == 0:
            # One part: no test of which ids fall where (a value read back to Python, which a
            # recorded step cannot replay); an id past the rows is indexing's IndexError.
            return self.parts[0][1].rows(flat).dequantize(dtype).reshape(*ids.shape, self.cols)
        out = torch.empty(flat.numel(), self.cols, dtype=dtype, device=flat.device)
        for start, t in self.parts:
            inside = (flat >= start) & (flat < start + t.shape[0])
            if bool(inside.any()):
                out[inside] = t.rows(flat[inside] - start).dequantize(dtype)
        return out.reshape(*ids.shape, self.cols)

    def __repr__(self) -> str:
        return f"QuantizedWeight({'+'.join(self.qtypes)}, shape=[{self.rows}, {self.cols}])"


# --------------------------------------------------------------------------- reference arithmetic
def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from its two bytes (last dim 2) as float32 (last dim 1)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return qs & 0x0F, qs >> 4


def dequantize(t: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of a quantized tensor, [rows, cols], in ``dtype`` (computed in float32)."""
    if t.qtype == "int8":
        return (t.data.float() * t.scale.float().unsqueeze(1)).to(dtype)
    t = t.ungrouped()
    rows, fmt = t.shape[0], t.format
    b = t.data.reshape(rows, -1, fmt.type_size)             # [rows, blocks, bytes]
    q = t.qtype
    if q == "Q8_0":
        out = _f16(b[..., :2]) * b[..., 2:].contiguous().view(torch.int8).float()
    elif q == "Q4_0":
        lo, hi = _nibbles(b[..., 2:18])
        out = _f16(b[..., :2]) * (torch.cat([lo, hi], -1).float() - 8)
    elif q == "Q4_1":
        lo, hi = _nibbles(b[..., 4:20])
        out = _f16(b[..., :2]) * torch.cat([lo, hi], -1).float() + _f16(b[..., 2:4])
    elif q in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        s = b[..., 4:16].int()
        sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
        mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
        qs = b[..., 48:176] if q == "Q5_K" else b[..., 16:144]
        lo, hi = _nibbles(qs.reshape(rows, -1, 4, 32))
        vals = torch.stack([lo, hi], 3).reshape(rows, -1, 8, 32).int()   # sub-block j = 2c + h
        if q == "Q5_K":
            qh = b[..., 16:48].int().unsqueeze(2)                          # [rows, nb, 1, 32]
            bits = (qh >> torch.arange(8, device=qh.device).view(1, 1, 8, 1)) & 1
            vals = vals + 16 * bits
        out = (d * sc.float()).unsqueeze(-1) * vals.float() - (dmin * mn.float()).unsqueeze(-1)
    elif q == "Q6_K":
        ql = b[..., 0:128].reshape(rows, -1, 2, 64).int()
        qh = b[..., 128:192].reshape(rows, -1, 2, 32).int()
        sc = b[..., 192:208].contiguous().view(torch.int8).float().reshape(rows, -1, 2, 4, 2)
        d = _f16(b[..., 208:210]).reshape(rows, -1, 1, 1, 1, 1)
        lo, hi = ql[..., :32], ql[..., 32:]
        vals = torch.stack([(lo & 0xF) | ((qh & 3) << 4), (hi & 0xF) | (((qh >> 2) & 3) << 4),
                            (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)],
                           3)                                              # [rows, nb, 2, 4, 32]
        vals = (vals - 32).float().reshape(rows, -1, 2, 4, 2, 16)
        out = d * sc.unsqueeze(-1) * vals
    else:                                                   # pragma: no cover - FORMATS is closed
        raise ValueError(f"no reference for {q}")
    return out.reshape(rows, t.cols).to(dtype)


def _regroup(data: torch.Tensor, qtype: str, group: bool) -> torch.Tensor:
    """Rows of blocks between the file's layout and the grouped one: each run of ``GROUP``
    blocks (the last run may be shorter) as [its blocks' heads][their values]. One gather of
    the row's bytes (an embedding lookup ungroups one row per token)."""
    index = _regroup_index(qtype, data.shape[1] // FORMATS[qtype].type_size, group)
    return data[:, index.to(data.device)]


@functools.lru_cache(maxsize=64)
def _regroup_index(qtype: str, nb: int, group: bool) -> torch.Tensor:
    """Where each byte of a row of ``nb`` blocks comes from, in ``_reorder``'s new order."""
    size = FORMATS[qtype].type_size
    return _reorder(torch.arange(nb * size).unsqueeze(0), qtype, group)[0]


def _reorder(data: torch.Tensor, qtype: str, group: bool) -> torch.Tensor:
    head, size = GROUPABLE[qtype], FORMATS[qtype].type_size
    rows, nb = data.shape[0], data.shape[1] // size
    runs = []
    for start in range(0, nb, GROUP):
        n = min(GROUP, nb - start)
        run = data[:, start * size:(start + n) * size]
        if group:
            b = run.reshape(rows, n, size)
            heads = [b[..., i:i + 2].reshape(rows, 2 * n) for i in range(0, head, 2)]
            runs += [*heads, b[..., head:].reshape(rows, -1)]
        else:
            parts = [run[:, 2 * n * i:2 * n * (i + 1)].reshape(rows, n, 2)
                     for i in range(head // 2)]
            values = run[:, head * n:].reshape(rows, n, size - head)
            runs.append(torch.cat([*parts, values], dim=2).reshape(rows, -1))
    return torch.cat(runs, dim=1).contiguous()


def _untail(rows: torch.Tensor, qtype: str) -> torch.Tensor:
    """The rows after an interleaved tensor's whole groups, in the file's layout."""
    return _regroup(rows, qtype, False) if qtype in GROUPABLE else rows


#: Each format's block, field by field, in the order the interleaved layout stores the fields
#: of a group's 8 rows: (first byte, end, how): ``f16``: the rows' 2-byte fields side by side;
#: ``bytes``: one byte of each row at a time; ``runs``: 32-byte chunks (or the whole field if
#: shorter), each as runs of 4 bytes of each row in turn.
_INTERLEAVED_FIELDS = {
    "Q8_0": ((0, 2, "f16"), (2, 34, "runs")),
    "Q4_0": ((0, 2, "f16"), (2, 18, "runs")),
    "Q4_1": ((0, 2, "f16"), (2, 4, "f16"), (4, 20, "runs")),
    "Q4_K": ((0, 2, "f16"), (2, 4, "f16"), (4, 16, "bytes"), (16, 144, "runs")),
    "Q5_K": ((0, 2, "f16"), (2, 4, "f16"), (4, 16, "bytes"), (16, 48, "runs"),
             (48, 176, "runs")),
    "Q6_K": ((208, 210, "f16"), (192, 208, "bytes"), (0, 128, "runs"), (128, 192, "runs")),
}


@functools.lru_cache(maxsize=64)
def _interleave_index(qtype: str, row_bytes: int) -> torch.Tensor:
    """For a group of ``INTERLEAVE`` rows of ``row_bytes`` each (the file's layout, row after
    row), where each byte of the interleaved group comes from: block by block, the fields of
    ``_INTERLEAVED_FIELDS`` in order."""
    size, r = FORMATS[qtype].type_size, INTERLEAVE
    nb = row_bytes // size
    src = torch.arange(r * row_bytes).view(r, nb, size).transpose(0, 1)     # [block, row, byte]
    fields = []
    for lo, hi, how in _INTERLEAVED_FIELDS[qtype]:
        f = src[..., lo:hi]                                                  # [block, row, width]
        if how == "bytes":
            f = f.transpose(1, 2)
        elif how == "runs":
            chunk = min(32, hi - lo)
            f = f.reshape(nb, r, (hi - lo) // chunk, chunk // 4, 4).permute(0, 2, 3, 1, 4)
        fields.append(f.reshape(nb, -1))
    return torch.cat(fields, dim=1).reshape(-1)


@functools.lru_cache(maxsize=64)
def _interleave_inverse(qtype: str, row_bytes: int) -> torch.Tensor:
    """Where byte j of row i of a group lies in the interleaved group: [INTERLEAVE, row_bytes]."""
    return torch.argsort(_interleave_index(qtype, row_bytes)).view(INTERLEAVE, row_bytes)


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """Per-output-channel symmetric int8 of a [rows, cols] float weight: scale ``amax / 127``
    per row (1 for an all-zero row), values rounded to nearest."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    data = torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return QuantizedTensor(data.contiguous(), "int8", w.shape[1], scale.contiguous())
