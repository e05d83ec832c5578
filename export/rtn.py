"""Round-to-nearest symmetric block quantization of one weight, byte for byte what ONNX Runtime's
weight-only quantizer writes (`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`
with `DefaultWeightOnlyQuantConfig(block_size, is_symmetric=True, bits, quant_axes=(("MatMul", 0),
("Gather", 1)))`), in numpy, one matrix at a time: no one-node graph, no private ONNX Runtime binding.

    B, scales = matmul_blocks(w, bits, block_size)          # MatMulNBits' inputs 1 and 2 of w [K, N]
    t = gather_blocks(table, 4, block_size)                  # GatherBlockQuantized's inputs 0 and 2 of E [V, d]
    w_q = dequantize_matmul(B, scales, K, bits, block_size)  # [K, N]: what MatMulNBits multiplies by
    e_q = dequantize_gather(t.data, t.scales, t.shape, block_size)

The quantizer has TWO rules, one per op (tests/export/test_rtn.py checks each against it, ONNX
Runtime 1.32; the MLAS source is onnxruntime/core/mlas/lib/q4_dq.cpp, `BlockwiseQuantizer::
quantizeAndTranspose` and `range2scale`; the Gather one is `DefaultWeightOnlyQuantizer.
quant_slice_symmetric` / `quantize_ndarray` / `pack_int8_to_int4` in matmul_nbits_quantizer.py):

MatMul -> MatMulNBits (the C++ MLAS kernel, `quantize_matmul_{4,8}bits`; blocks along K of w [K, N],
    unsigned codes with the implicit zero point z = 2^(bits-1), i.e. 8 or 128, and no zero-point tensor):
      m      = the block's value of largest magnitude, WITH its sign; on a tie |max| == |min| the
               negative one (`fabsf(max) > fabsf(min) ? max : min`); of an all-zero block, its first
               element (so its sign: MLAS's strict < / > scan never replaces the first zero)
      scale  = fp32(-m / z)                      (-m/8 for 4 bits, -m/128 for 8: exact, a power of 2)
      r      = fp32(1 / scale), 0 where scale == 0
      q      = min(roundf(fp32(fp32(v * r) + z)), 2z - 1)   roundf: half AWAY from zero; no FMA
    so m itself gets code 0 (-z after the zero point) and a value -m gets 2z, clamped to 2z - 1.
    (Where |m| < 2^-125 (4 bits) or 2^-121 (8 bits), 1 / scale overflows to r = inf: codes of -inf
    and NaN are 0, as MLAS's float -> uint8 casts make them on x86.) Blocks are the K rows of one
    column; the quantizer pads w with zero rows to whole blocks, but MLAS scans a last, partial block
    over its real rows only.
    B [N, ceil(K/block), block*bits/8] uint8: 4 bits two codes a byte, row k in the LOW nibble and
    k+1 in the high one; the bytes of rows K..padded K are 0, except, for 4 bits and an odd K, the
    high nibble of row K-1's byte: MLAS leaves there the code of row K-2 (a stale register: its
    threads take 2*block rows; 0 where row K-1 starts such a thread block, i.e. (K-1) % (2*block) == 0).
    scales [N, ceil(K/block)] in w's dtype (fp32; fp16 for an fp16 w: then r = 1 / the fp16 scale).

Gather -> GatherBlockQuantized (numpy, 4 bits only: ONNX Runtime logs "Gather only supports 4 bits
    quantization" and leaves an int8 Gather alone; blocks along d of E [V, d], SIGNED codes, no zero point):
      m      = as above (np.where(|max| > |min|, max, min), ties -> min); of an all-zero block,
               np.min of it: a zero whose sign is numpy's choice (the last element's for power-of-2
               lengths in numpy 1.26), made here by the same reduction over the same contiguous block
      scale  = m / -8                            (in the table's dtype)
      q      = clip(round_half_EVEN(v / scale), -8, 7), 0 where scale == 0     (a DIVISION, not v * r)
    a last, partial block of d is its own (no padding); data is an INT4 tensor of dims [V, d]: the
    row-major [V, d] codes two a byte, element 2i in the low nibble, a 0 nibble after an odd V*d;
    scales [V, ceil(d/block)] in the table's dtype.

So a value on an exact half step rounds differently in the two ops (10.5 -> 11 in a MatMul, 2.5 -> 2
in a Gather), and the codes of one matrix differ between the two by more than the zero point.
Non-finite weights are refused (ValueError): what MLAS does with them is undefined behaviour.

Vectorised over tiles of about CHUNK_ELEMENTS elements (a few MB of temporaries, whatever the matrix), of
w's columns or, where w is a transposed view of nn.Linear's rows [N, K] (a build's weights), of those rows:
a 4096 x 14336 fp32 matrix in int4 blocks of 32 takes ~0.2-0.25 s on one core (the private binding
~0.6-0.9 s with its thread pool, the one-node quantizer ~1.2-2.5 s); a 32064 x 4096 table ~0.5 s (the
one-node quantizer ~6 s).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

__all__ = ["matmul_blocks", "gather_blocks", "GatherBlocks", "dequantize_matmul", "dequantize_gather"]

MATMUL_BITS = (4, 8)
CHUNK_ELEMENTS = 1 << 18        # elements of w quantized at once (1 MB of fp32): temporaries within a core's L2
                                # (on the 2-core EPYC, 2 MB a core: 15-45 % faster than 1 << 20 in each layout)
TILE_COLUMNS = 1024             # columns of w [K, N] a tile takes


def _check(w: np.ndarray, bits: int, block_size: int, bit_choices) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, found shape {w.shape}")
    if w.dtype not in (np.float32, np.float16):
        raise ValueError(f"expected a float32 or float16 weight, found {w.dtype}")
    if bits not in bit_choices:
        raise ValueError(f"expected bits in {bit_choices}, found {bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"expected a block size a power of 2 >= 16, found {block_size}")
    return w


def _signed_extreme(xb: np.ndarray, axis: int) -> np.ndarray:
    """The value of largest magnitude along `axis`, with its sign; on a tie |max| == |min| the min."""
    mx = xb.max(axis=axis)
    mn = xb.min(axis=axis)
    return np.where(np.abs(mx) > np.abs(mn), mx, mn)


def _block_extremes(xb: np.ndarray, axis: int) -> np.ndarray:
    """_signed_extreme of each block along `axis`. numpy reduces a short last axis slowly: blocks along the
    last axis (nn.Linear's rows, a table's rows) are read transposed first, 2.5x faster at block 32 (the same
    values: max and min are exact)."""
    bs = xb.shape[axis]
    if axis != xb.ndim - 1 or bs > 64:
        return _signed_extreme(xb, axis)
    t = np.ascontiguousarray(xb.reshape(-1, bs).T)
    return _signed_extreme(t, 0).reshape(xb.shape[:-1])


def _finite(scales: np.ndarray, what: str) -> None:
    if not np.isfinite(scales).all():          # a NaN or inf in a block makes its scale one
        raise ValueError(f"{what}: the weight holds NaN or inf; quantize finite weights only")


# --- MatMul -> MatMulNBits ---------------------------------------------------------------------

@np.errstate(divide="ignore", invalid="ignore", over="ignore")    # subnormal scales; non-finite w, refused after
def _matmul_codes(xb: np.ndarray, bits: int, axis: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Scales (w's dtype) and uint8 codes (xb's shape) of the blocks xb, each along `axis`: [nb, block, n]
    (axis 1: scales [nb, n]) or [n, nb, block] (axis 2: scales [n, nb])."""
    z = np.float32(1 << (bits - 1))
    m = _block_extremes(xb, axis).astype(np.float32)
    zero = m == 0
    if zero.any():                             # an all-zero block: MLAS keeps its first element's sign
        m = np.where(zero, np.take(xb, 0, axis=axis).astype(np.float32), m)
    scale = (-m / z).astype(xb.dtype)          # ScaleT(-max / halfRange)
    s32 = scale.astype(np.float32)
    r = np.where(s32 == 0, np.float32(0), np.float32(1) / s32)      # reciprocal_scale
    x = np.multiply(xb, np.expand_dims(r, axis), dtype=np.float32)
    x += z                                     # p = fp32(fp32(v * r) + z): two roundings, no FMA
    # roundf(p) (half away from zero) is trunc(fp32(p + 0.5)) for every p this makes: p >= -1e-6, and p is a
    # multiple of 2^-21 (8 bits: 2^-17), so p + 0.5 is exact wherever it is below 8 (8 bits: 128); from there
    # it may round to a step of 2^-20 (2^-16), which no integer is within reach of
    x += np.float32(0.5)
    top = (1 << bits) - 1
    if np.isinf(r).any():                      # 1 / a subnormal scale (|m| < 2^-125 or 2^-121): +-inf and 0 * inf = NaN
        np.minimum(x, np.float32(top), out=x)  # codes; MLAS's (uint8_t) of -inf and NaN is 0 on x86
        np.fmax(x, np.float32(0), out=x)
        return scale, x.astype(np.uint8)
    if bits == 8:
        np.minimum(x, np.float32(top), out=x)  # the clamp (p + 0.5 reaches 256.5: past uint8)
        return scale, x.astype(np.uint8)
    codes = x.astype(np.uint8)                 # trunc (p + 0.5 > 0), at most 16
    return scale, np.minimum(codes, np.uint8(top), out=codes)      # the clamp, on bytes: 5x faster than on floats


def _pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """[nb, block, n] codes -> [nb, block*bits/8, n] bytes, row 2i in the low nibble of byte i."""
    if bits == 8:
        return codes
    return codes[:, 0::2, :] | (codes[:, 1::2, :] << 4)


def matmul_blocks(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' B [N, K/block, block*bits/8] uint8 and scales [N, K/block] (fp32; fp16 for an fp16 w)
    of the weight w [K, N], symmetric, byte for byte as ONNX Runtime's quantizer writes them (no zero
    points: the quantizer writes none for is_symmetric=True). K/block is rounded up. The rule: the
    module's docstring. Written as initializers they are `numpy_helper.from_array(B)` and
    `numpy_helper.from_array(scales)` (UINT8 and FLOAT raw data), the quantizer's W_Q{bits} and W_scales."""
    w = _check(w, bits, block_size, MATMUL_BITS)
    K, N = w.shape
    kb, per_byte = -(-K // block_size), 8 // bits
    blob = block_size // per_byte
    B = np.zeros((N, kb, blob), dtype=np.uint8)
    scales = np.empty((N, kb), dtype=w.dtype)
    if w.T.flags.c_contiguous and K > 1:        # nn.Linear's rows [N, K], seen transposed: read as rows
        _blocks_of_rows(w.T, bits, block_size, B, scales)
        _finite(scales, "matmul_blocks")
        return B, scales
    full = K // block_size
    # tiles of TILE_COLUMNS columns by as many full blocks as CHUNK_ELEMENTS allow: [rows, c] ->
    # [blocks, block, c], their bytes transposed into B's [c, blocks, blob]
    cols = min(N, TILE_COLUMNS)
    tile_blocks = max(1, CHUNK_ELEMENTS // (cols * block_size))
    for c0 in range(0, N, cols):
        c1 = min(N, c0 + cols)
        last = None                             # the code of the last full block's last row
        for b0 in range(0, full, tile_blocks):
            b1 = min(full, b0 + tile_blocks)
            xb = w[b0 * block_size:b1 * block_size, c0:c1].reshape(b1 - b0, block_size, c1 - c0)
            s, codes = _matmul_codes(xb, bits)
            scales[c0:c1, b0:b1] = s.T
            B[c0:c1, b0:b1, :] = _pack_rows(codes, bits).transpose(2, 0, 1)
            last = codes[-1, -1]
        if full < kb:                           # the last, partial block: its real rows only
            tail = w[full * block_size:, c0:c1]
            rows = tail.shape[0]
            s, codes = _matmul_codes(tail[None], bits)      # [1, rows, c]
            scales[c0:c1, full] = s[0]
            codes = codes[0]
            if per_byte == 2 and rows % 2:
                # MLAS's stale high nibble after row K-1 (see the module's docstring)
                if (K - 1) % (2 * block_size) == 0:
                    stale = np.zeros_like(codes[0])
                else:
                    stale = codes[rows - 2] if rows > 1 else last
                codes = np.concatenate([codes, stale[None]], axis=0)
            packed = _pack_rows(codes[None], bits)[0]       # [ceil(rows*bits/8), c]
            B[c0:c1, full, :packed.shape[0]] = packed.T
    _finite(scales, "matmul_blocks")
    return B, scales


def _blocks_of_rows(rows: np.ndarray, bits: int, block_size: int, B: np.ndarray, scales: np.ndarray) -> None:
    """matmul_blocks of w = rows.T into B and scales, read from the rows [N, K] (nn.Linear's layout, as a build's
    weights come): each block is `block_size` consecutive values and its bytes land in B's order, with no
    transpose (a 2048 x 8192 weight in int4 blocks of 32, one core: 0.095 s against 0.136 s by its columns).
    The same bytes, rule by rule (tests/export/test_rtn.py checks both layouts against the quantizer)."""
    N, K = rows.shape
    full, kb, per_byte = K // block_size, B.shape[1], 8 // bits
    step = max(1, CHUNK_ELEMENTS // K)                  # rows a tile takes
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        last = None                                     # each row's code of its last full block's last value
        if full:
            xb = rows[n0:n1, :full * block_size].reshape(n1 - n0, full, block_size)
            scales[n0:n1, :full], codes = _matmul_codes(xb, bits, axis=2)
            B[n0:n1, :full, :] = _pack_last(codes, bits)
            last = codes[:, -1, -1]
        if full < kb:                                   # the last, partial block: its real values only
            tail = rows[n0:n1, full * block_size:]
            n = tail.shape[1]
            s, codes = _matmul_codes(tail[:, None, :], bits, axis=2)       # [rows, 1, n]
            scales[n0:n1, full] = s[:, 0]
            codes = codes[:, 0, :]
            if per_byte == 2 and n % 2:                 # MLAS's stale high nibble after value K-1 (module docstring)
                stale = np.zeros_like(codes[:, 0]) if (K - 1) % (2 * block_size) == 0 else \
                    codes[:, n - 2] if n > 1 else last
                codes = np.concatenate([codes, stale[:, None]], axis=1)
            packed = _pack_last(codes, bits)
            B[n0:n1, full, :packed.shape[-1]] = packed


def _pack_last(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes along the last axis -> bytes along it, value 2i in the low nibble of byte i (4 bits)."""
    if bits == 8:
        return codes
    if codes.shape[-1] % 2 or not codes.flags.c_contiguous or sys.byteorder != "little":
        return codes[..., 0::2] | (codes[..., 1::2] << 4)
    pairs = codes.view(np.uint16)              # value 2i in the low byte: one pass, not two strided reads
    return ((pairs & 0x0F) | ((pairs >> 4) & 0xF0)).astype(np.uint8)


def dequantize_matmul(B: np.ndarray, scales: np.ndarray, K: int, bits: int, block_size: int) -> np.ndarray:
    """The fp32 weight [K, N] the blocks stand for, as MLAS dequantizes them: (q - 2^(bits-1)) * scale,
    one fp32 product (exact: what MatMulNBits multiplies by, up to its own summation). A transposed view
    of [N, K] rows (w.T is nn.Linear's layout, contiguous)."""
    B = np.asarray(B, dtype=np.uint8)
    N, kb, blob = B.shape
    if bits == 4:
        q = np.empty((N, kb, 2 * blob), dtype=np.uint8)
        q[:, :, 0::2] = B & 0x0F
        q[:, :, 1::2] = B >> 4
    elif bits == 8:
        q = B
    else:
        raise ValueError(f"expected bits in {MATMUL_BITS}, found {bits}")
    if q.shape[2] != block_size or kb != -(-K // block_size):
        raise ValueError(f"blocks {B.shape} do not hold K={K} in {bits}-bit blocks of {block_size}")
    w = q.astype(np.float32)
    w -= np.float32(1 << (bits - 1))
    w *= np.asarray(scales).astype(np.float32).reshape(N, kb)[:, :, None]
    # [K, N] as a view of the rows [N, K]: a caller wanting nn.Linear's layout takes .T without a copy
    return w.reshape(N, kb * block_size)[:, :K].T


# --- Gather -> GatherBlockQuantized -----------------------------------------------------------

@dataclass(frozen=True)
class GatherBlocks:
    """GatherBlockQuantized's data and scales of a table [V, d] (quantize_axis 1, gather_axis 0, no zero
    points). `data` is the INT4 tensor's raw bytes, flat uint8 [ceil(V*d/2)]: its dims are `shape`, its
    data_type `data_type` (onnx.TensorProto.INT4 = 22); `scales` [V, ceil(d/block)] is a plain array in
    the table's dtype. As the quantizer's initializers: helper.make_tensor(name, data_type, shape, data.tobytes(),
    raw=True) and numpy_helper.from_array(scales, name)."""
    data: np.ndarray
    scales: np.ndarray
    shape: tuple[int, int]
    data_type: int = 22                         # onnx.TensorProto.INT4 (signed: is_symmetric=True)


@np.errstate(divide="ignore", invalid="ignore", over="ignore")
def _gather_codes(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scales [r, nb] and int8 codes [r, nb, block] of the blocks xb [r, nb, block], as
    DefaultWeightOnlyQuantizer.quant_slice_symmetric computes them."""
    m = _block_extremes(xb, 2)
    zero = m == 0
    if zero.any():
        # an all-zero block: m is the quantizer's np.min of it (|max| > |min| fails), whose sign of zero is
        # numpy's choice; the same reduction over the same contiguous block makes the same one
        m[zero] = np.ascontiguousarray(xb[zero]).min(axis=1)
    scale = m / xb.dtype.type(-8.0)
    zero = scale == 0
    q = xb / scale[:, :, None]
    if zero.any():                             # np.where(scale == 0, 0, data / scale)
        q[np.broadcast_to(zero[:, :, None], q.shape)] = 0
    np.rint(q, out=q)                          # numpy's round: half to even
    np.clip(q, -8, 7, out=q)
    return scale, q.astype(np.int8)


def gather_blocks(table: np.ndarray, bits: int, block_size: int) -> GatherBlocks:
    """GatherBlockQuantized's tensors of a table [V, d] quantized along d (quant axis 1), byte for byte as
    ONNX Runtime's quantizer writes them (its inputs 0, data, and 2, scales; no zero points). Only 4 bits:
    the quantizer leaves a Gather in any other bits unquantized (ValueError here). The rule: the module's
    docstring."""
    table = _check(table, bits, block_size, (4,))
    V, d = table.shape
    full, rem = divmod(d, block_size)
    kb = full + (rem > 0)
    data = np.empty(-(-V * d // 2), dtype=np.uint8)
    scales = np.empty((V, kb), dtype=table.dtype)
    rows = max(2, CHUNK_ELEMENTS // max(1, d)) // 2 * 2       # even: a chunk starts on a whole byte
    for r0 in range(0, V, rows):
        r1 = min(V, r0 + rows)
        x = table[r0:r1]
        codes = np.empty((r1 - r0, d), dtype=np.int8)
        if full:
            s, q = _gather_codes(x[:, :full * block_size].reshape(r1 - r0, full, block_size))
            scales[r0:r1, :full] = s
            codes[:, :full * block_size] = q.reshape(r1 - r0, -1)
        if rem:
            s, q = _gather_codes(x[:, full * block_size:][:, None, :])
            scales[r0:r1, full] = s[:, 0]
            codes[:, full * block_size:] = q[:, 0]
        flat = codes.view(np.uint8).reshape(-1)
        if flat.size % 2:
            flat = np.append(flat, np.uint8(0))
        data[r0 * d // 2:r0 * d // 2 + flat.size // 2] = (flat[0::2] & 0x0F) | (flat[1::2] << 4)
    _finite(scales, "gather_blocks")
    return GatherBlocks(data, scales, (V, d))


def dequantize_gather(data: np.ndarray, scales: np.ndarray, shape: tuple[int, int], block_size: int) -> np.ndarray:
    """The fp32 table [V, d] GatherBlockQuantized's rows stand for: q * scale, q the signed int4 codes."""
    V, d = shape
    data = np.asarray(data, dtype=np.uint8).reshape(-1)
    q = np.empty(2 * data.size, dtype=np.int8)
    q[0::2] = (data & 0x0F).astype(np.int8)
    q[1::2] = (data >> 4).astype(np.int8)
    q[q > 7] -= 16                              # sign of the nibble
    e = q[:V * d].reshape(V, d).astype(np.float32)
    e *= np.repeat(np.asarray(scales).astype(np.float32), block_size, axis=1)[:, :d]
    return e
