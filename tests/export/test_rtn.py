"""export/rtn.py: our numpy round-to-nearest block quantizer writes, byte for byte, what ONNX Runtime's
public weight-only quantizer writes (export/quantize.py `quantize_one_node`: MatMulNBitsQuantizer with
DefaultWeightOnlyQuantConfig, symmetric), for MatMul weights (MatMulNBits, 4 and 8 bits) and Gather
tables (GatherBlockQuantized, 4 bits); what its private binding writes (the streamed build's bytes so
far); and what ONNX Runtime's kernels read back from those tensors. The speed check prints, asserts nothing."""
import time

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import export.rtn as rtn
from export.quantize import QuantConfig, quantize_one_node
from export.rtn import dequantize_gather, dequantize_matmul, gather_blocks, matmul_blocks

# the quantizer's own np.where(scale == 0, 0, data / scale) divides 0 by 0 on an all-zero block
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")

BLOCKS = (16, 32, 64, 128, 256)
DTYPE = {4: "int4", 8: "int8"}


def _ks(block: int) -> list[int]:
    """K (or d) a multiple of the block and not: one partial block alone (1, 33 < 64), an odd K whose last
    row starts an MLAS thread block (2*block+1) or not (block+1: the stale nibble is the last full block's;
    3*block+17: the partial block's own), even ones (96, 100)."""
    return sorted({1, 33, 96, 100, block + 1, 2 * block + 1, 3 * block + 17})


def _column(K: int, block: int, fill) -> np.ndarray:
    col = np.empty(K, dtype=np.float64)
    for b0 in range(0, K, block):
        n = min(block, K - b0)
        col[b0:b0 + n] = fill(n)
    return col


def _weights(K: int, block: int, bits: int, rng, extra: int = 0) -> np.ndarray:
    """w [K, N] fp32, one kind of weight a column (N = 14 + extra): each column's blocks are along K."""
    z = 1 << (bits - 1)

    def halves(sign):               # the extreme sign*z*s, the rest on exact half steps of the scale s
        def fill(n):
            s = 2.0 ** rng.integers(-8, 8)
            v = (rng.integers(-z, z, size=n) + 0.5) * s
            v[0] = sign * z * s
            return v
        return fill

    def near_halves(n):             # an inexact reciprocal, values one ulp off the half steps: FMA or not
        m = np.float32(-rng.uniform(0.1, 10.0))
        s = np.float32(-m / np.float32(z))
        v = ((rng.integers(-z, z, size=n) + 0.5) * np.float64(s)).astype(np.float32)
        v = np.nextafter(v, v + rng.choice([-1, 1], size=n).astype(np.float32))
        v[0] = m
        return v.astype(np.float64)

    def equal_magnitudes(n):        # |max| == |min|: the negative one is the extreme; +a is clamped
        a = rng.uniform(0.5, 2.0)
        v = rng.standard_normal(n) * a / 4
        v[0] = a
        if n > 1:
            v[1] = -a
        return v

    def signed_zeros(n):
        return np.where(rng.integers(0, 2, size=n).astype(bool), -0.0, 0.0)

    def some_zero_blocks(n):        # an all +0 block, an all -0 block, a normal one, at random
        kind = rng.integers(0, 3)
        return np.zeros(n) if kind == 0 else np.full(n, -0.0) if kind == 1 else rng.standard_normal(n)

    def at_max(n):
        v = rng.standard_normal(n)
        return v / np.abs(v).max() * 3.4e38

    cols = [
        _column(K, block, lambda n: rng.standard_normal(n)),
        _column(K, block, halves(-1)),
        _column(K, block, halves(+1)),
        _column(K, block, near_halves),
        _column(K, block, near_halves),
        _column(K, block, equal_magnitudes),
        -np.abs(rng.standard_normal(K)),                            # every extreme negative
        _column(K, block, signed_zeros),
        _column(K, block, some_zero_blocks),
        rng.standard_normal(K) * 1e30,
        _column(K, block, at_max),
        rng.standard_normal(K) * 1e-30,
        rng.standard_normal(K) * 1e-41,                             # subnormal weights and scales
        rng.integers(-50, 50, size=K) / 7,                          # repeated values
    ] + [rng.standard_normal(K) for _ in range(extra)]
    w = np.stack(cols, axis=1).astype(np.float32)
    assert np.isfinite(w).all()
    return w


def data_tensor(t: rtn.GatherBlocks, name: str) -> TensorProto:
    """GatherBlocks' data as the quantizer's INT4 initializer."""
    return helper.make_tensor(name, t.data_type, list(t.shape), t.data.tobytes(), raw=True)


def scales_tensor(t: rtn.GatherBlocks, name: str) -> TensorProto:
    return numpy_helper.from_array(t.scales, name)


def assert_same_tensor(mine: TensorProto, theirs: TensorProto, what: str) -> None:
    """Same data type, dims and bytes (and name: the whole serialized TensorProto equal)."""
    assert mine.data_type == theirs.data_type, f"{what}: data type {mine.data_type} != {theirs.data_type}"
    assert list(mine.dims) == list(theirs.dims), f"{what}: dims {list(mine.dims)} != {list(theirs.dims)}"
    a = np.frombuffer(mine.raw_data, np.uint8)
    b = np.frombuffer(theirs.raw_data, np.uint8)
    if a.size == b.size and (a != b).any():
        i = np.flatnonzero(a != b)
        pytest.fail(f"{what}: {i.size} of {a.size} bytes differ, first at byte {i[0]}: {a[i[0]]} != {b[i[0]]}")
    assert a.size == b.size, f"{what}: {a.size} bytes != {b.size}"
    assert mine.SerializeToString() == theirs.SerializeToString(), f"{what}: the TensorProtos differ"


def _check_matmul(w: np.ndarray, bits: int, block: int, what: str) -> None:
    theirs = quantize_one_node("MatMul", w, QuantConfig(DTYPE[bits], block, 0))
    assert sorted(theirs) == [1, 2], f"{what}: the quantizer wrote inputs {sorted(theirs)} (zero points?)"
    B, scales = matmul_blocks(w, bits, block)
    assert_same_tensor(numpy_helper.from_array(B, theirs[1].name), theirs[1], f"{what} B")
    assert_same_tensor(numpy_helper.from_array(scales, theirs[2].name), theirs[2], f"{what} scales")


def _check_gather(table: np.ndarray, block: int, what: str) -> None:
    theirs = quantize_one_node("Gather", table, QuantConfig("int4", block, 0))
    assert sorted(theirs) == [0, 2], f"{what}: the quantizer wrote inputs {sorted(theirs)} (zero points?)"
    mine = gather_blocks(table, 4, block)
    assert_same_tensor(data_tensor(mine, theirs[0].name), theirs[0], f"{what} data")
    assert_same_tensor(scales_tensor(mine, theirs[2].name), theirs[2], f"{what} scales")


# --- byte equality with the public quantizer ----------------------------------------------------

LAYOUTS = {"columns": lambda w: w,                  # w [K, N] row-major: read by tiles of its columns
           "rows": np.asfortranarray}                # nn.Linear's rows [N, K] seen transposed (a build's weights)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", BLOCKS)
def test_matmul_blocks_are_the_quantizers_bytes(bits, block, layout):
    rng = np.random.default_rng(block * 10 + bits)
    for K in _ks(block):
        for extra in (0, 1):                                        # N even (14) and odd (15)
            _check_matmul(LAYOUTS[layout](_weights(K, block, bits, rng, extra)), bits, block,
                          f"int{bits} block {block} K {K} {layout}")


@pytest.mark.parametrize("block", BLOCKS)
def test_gather_blocks_are_the_quantizers_bytes(block):
    """The same kinds of weights as rows of a table [V, d] (blocks along d), V even and odd (so V*d odd too)."""
    rng = np.random.default_rng(block)
    for d in _ks(block):
        for extra in (0, 1):
            table = np.ascontiguousarray(_weights(d, block, 4, rng, extra).T)
            _check_gather(table, block, f"table block {block} d {d} V {table.shape[0]}")


@pytest.mark.parametrize("bits", [4, 8])
def test_fp16_weights_give_the_quantizers_fp16_scales(bits):
    rng = np.random.default_rng(bits)
    for K in (33, 100):
        w = rng.standard_normal((K, 7)).astype(np.float16)
        w[:16, 0] = 0.0
        for layout, laid in LAYOUTS.items():
            _check_matmul(laid(w), bits, 32, f"fp16 int{bits} K {K} {layout}")
        if bits == 4:
            _check_gather(np.ascontiguousarray(w.T), 32, f"fp16 table d {K}")
    assert matmul_blocks(w, bits, 32)[1].dtype == np.float16


def test_tiles_and_row_chunks_change_no_byte(monkeypatch):
    """The default tiles are wider than the tests' matrices: cut them small, across columns, blocks and rows."""
    monkeypatch.setattr(rtn, "TILE_COLUMNS", 3)
    monkeypatch.setattr(rtn, "CHUNK_ELEMENTS", 100)
    rng = np.random.default_rng(7)
    for bits in (4, 8):
        for layout, laid in LAYOUTS.items():
            _check_matmul(laid(_weights(7 * 16 + 9, 16, bits, rng, 1)), bits, 16, f"tiled int{bits} {layout}")
    _check_gather(np.ascontiguousarray(_weights(4 * 16 + 5, 16, 4, rng, 1).T), 16, "row chunks, d odd, V odd")
    _check_gather(np.ascontiguousarray(_weights(200, 128, 4, rng).T), 128, "row chunks, block 128")
    w = _weights(100, 32, 4, rng, 1)                 # a strided view (an LM head's E^T) needs no copy first
    for got, want in zip(matmul_blocks(np.asfortranarray(w), 4, 32), matmul_blocks(w, 4, 32)):
        assert got.tobytes() == want.tobytes()


def test_onnx_runtime_quantizes_a_gather_in_4_bits_only():
    """An int8 Gather: ONNX Runtime's quantizer logs an error and leaves the node as it was; so do we (refused)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    from export.quantize import algo_config, quiet_quantizer
    table = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gather", ["W", "ids"], ["y"], name="one")], "one",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
                          [numpy_helper.from_array(table, "W")])
    with quiet_quantizer():
        q = MatMulNBitsQuantizer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]),
                                 algo_config=algo_config(QuantConfig("int8", 32), ("Gather",)))
        q.process()
    assert [n.op_type for n in q.model.model.graph.node] == ["Gather"]
    with pytest.raises(ValueError, match="bits"):
        gather_blocks(table, 8, 32)


# --- the rule, spelled out ------------------------------------------------------------------------

def test_the_rounding_rules_on_a_worked_block():
    """A block whose extreme is -4: scale 0.5 in both ops. MatMul: q = roundf(v * 2 + 8), half AWAY from zero,
    +4 -> 16 clamped to 15; Gather: q = round_half_even(v / 0.5), +4 -> 8 clamped to 7. And a block with
    |max| == |min| takes the negative one (scale +), one of zeros the first element's sign (MatMul)."""
    v = np.zeros(32, np.float32)
    v[:7] = [-4.0, 1.25, -1.25, 0.25, 0.75, 4.0, 1.0]
    v[16:19] = [3.0, -3.0, 1.0]                                    # second block: a tie, the min (-3) wins
    w = np.stack([v, v], axis=1)
    w[:16, 1] = -0.0                                                # an all-zero block led by -0.0
    w[1:16, 1] = 0.0
    B, scales = matmul_blocks(w, 4, 16)
    codes = np.stack([B & 15, B >> 4], axis=-1).reshape(2, 2, 16)
    assert codes[0, 0, :7].tolist() == [0, 11, 6, 9, 10, 15, 10]
    assert scales[0].tolist() == [0.5, 0.375] and codes[0, 1, :3].tolist() == [16 - 1, 0, 11]
    assert np.signbit(scales[1, 0]) == np.False_ and scales[1, 0] == 0      # -(-0.0) / 8 = +0.0
    theirs = quantize_one_node("MatMul", w, QuantConfig("int4", 16, 0))
    np.testing.assert_array_equal(numpy_helper.to_array(theirs[1]), B)
    assert numpy_helper.to_array(theirs[2]).tobytes() == scales.tobytes()

    t = gather_blocks(v[None, :], 4, 16)
    q = np.stack([t.data & 15, t.data >> 4], axis=-1).reshape(-1).astype(np.int8)
    q[q > 7] -= 16
    assert q[:7].tolist() == [-8, 2, -2, 0, 2, 7, 2] and t.scales.tolist() == [[0.5, 0.375]]
    assert _quantizers_gather_bytes(v[None, :], 16) == t.data.tobytes()


def _quantizers_gather_bytes(table, block):
    return quantize_one_node("Gather", table, QuantConfig("int4", block, 0))[0].raw_data


def _matmul_codes_by(w: np.ndarray, bits: int, block: int, fma: bool, half_even: bool) -> np.ndarray:
    """The codes [K, N] of w (K a multiple of the block) by a candidate rule: one rounding of v * r + z (FMA)
    or two, half to even or away from zero."""
    K, N = w.shape
    z = 1 << (bits - 1)
    xb = w.reshape(K // block, block, N)
    mx, mn = xb.max(axis=1), xb.min(axis=1)
    s = -np.where(np.abs(mx) > np.abs(mn), mx, mn) / np.float32(z)
    with np.errstate(divide="ignore"):
        r = np.where(s == 0, np.float32(0), np.float32(1) / s)[:, None, :]
    x = (xb.astype(np.float64) * r + z).astype(np.float32) if fma else xb * r + np.float32(z)
    q = np.rint(x) if half_even else np.floor(x) + (x - np.floor(x) >= 0.5)
    return np.clip(q, 0, 2 * z - 1).astype(np.uint8).reshape(K, N)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_tests_weights_tell_the_rounding_rules_apart(bits):
    """Evidence for the rule: on the tests' weights ONNX Runtime's codes are two fp32 roundings (v * r, then
    + z: no FMA) and roundf (half away from zero); an FMA or round-half-even quantizer would differ."""
    rng = np.random.default_rng(11)
    w = np.concatenate([_weights(256, 32, bits, rng)[:, 1:5] for _ in range(8)], axis=1)   # halves, near halves
    B = numpy_helper.to_array(quantize_one_node("MatMul", w, QuantConfig(DTYPE[bits], 32, 0))[1])
    ort = (np.stack([B & 15, B >> 4], axis=-1) if bits == 4 else B).reshape(w.shape[1], -1).T
    assert np.array_equal(ort, _matmul_codes_by(w, bits, 32, fma=False, half_even=False))
    assert (ort != _matmul_codes_by(w, bits, 32, fma=True, half_even=False)).sum() > 0
    assert (ort != _matmul_codes_by(w, bits, 32, fma=False, half_even=True)).sum() > 0


def test_an_odd_k_leaves_mlas_stale_nibble():
    """K odd, 4 bits: the high nibble after row K-1 holds row K-2's code (MLAS's threads take 2*block rows)
    unless row K-1 starts such a thread block; the bytes after it are 0."""
    w = np.random.default_rng(3).standard_normal((2 * 16 + 17, 3)).astype(np.float32)  # K 49, block 16
    B, _ = matmul_blocks(w, 4, 16)
    codes = np.stack([B & 15, B >> 4], axis=-1).reshape(3, -1)                           # [N, 64]
    assert (codes[:, 49] == codes[:, 47]).all() and (B[:, 3, 1:] == 0).all()
    np.testing.assert_array_equal(numpy_helper.to_array(quantize_one_node("MatMul", w, QuantConfig("int4", 16))[1]), B)
    B, _ = matmul_blocks(w[:33], 4, 16)                                                  # row 32 starts a thread block
    assert (B[:, 2, 0] >> 4 == 0).all()


def test_non_finite_weights_and_unknown_settings_are_refused():
    w = np.ones((32, 2), np.float32)
    for bad in (np.nan, np.inf):
        w[3, 1] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            matmul_blocks(w, 4, 32)
        with pytest.raises(ValueError, match="NaN or inf"):
            gather_blocks(w.T.copy(), 4, 32)
    with pytest.raises(ValueError, match="bits"):
        matmul_blocks(np.ones((32, 2), np.float32), 2, 32)
    with pytest.raises(ValueError, match="block size"):
        matmul_blocks(np.ones((32, 2), np.float32), 4, 24)
    with pytest.raises(ValueError, match="float32 or float16"):
        matmul_blocks(np.ones((32, 2)), 4, 32)


# --- the private binding the streamed build called so far ------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_private_bindings_bytes_are_unchanged(bits, dtype):
    binding = pytest.importorskip("onnxruntime.capi._pybind_state")
    fn = getattr(binding, f"quantize_matmul_{bits}bits", None)
    if fn is None:
        pytest.skip(f"onnxruntime has no quantize_matmul_{bits}bits")
    rng = np.random.default_rng(bits)
    for block in (16, 32, 128):
        for K in (33, 96, 100, 2 * block + 1, 3 * block + 17):
            w = (_weights(K, block, bits, rng, 1) if dtype == np.float32
                 else rng.standard_normal((K, 9)).astype(np.float16))
            rows, cols = w.shape
            kb = -(-rows // block)
            packed = np.zeros((cols, kb, block * bits // 8), np.uint8)          # as the private binding is called
            scales = np.zeros((cols, kb), dtype)
            fn(packed, np.pad(w, ((0, kb * block - rows), (0, 0))), scales, np.zeros((cols, kb), np.uint8),
               block, cols, rows, True)
            B, s = matmul_blocks(w, bits, block)
            np.testing.assert_array_equal(B, packed, err_msg=f"block {block} K {K}")
            assert s.dtype == scales.dtype and s.tobytes() == scales.tobytes(), f"block {block} K {K}"


# --- what ONNX Runtime's kernels read back ------------------------------------------------------------

def _session(node, inputs, outputs, inits):
    import onnxruntime as ort
    g = helper.make_graph([node], "one", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("accuracy_level", [0, 1])
def test_matmul_nbits_multiplies_by_the_dequantized_weight(bits, accuracy_level):
    rng = np.random.default_rng(bits + accuracy_level)
    for block in (16, 32, 128):
        for K in (33, 96, 100):
            w = rng.standard_normal((K, 7)).astype(np.float32)
            B, scales = matmul_blocks(w, bits, block)
            node = helper.make_node("MatMulNBits", ["x", "B", "scales"], ["y"], domain="com.microsoft", K=K, N=7,
                                    bits=bits, block_size=block, accuracy_level=accuracy_level)
            sess = _session(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 7])],
                            [numpy_helper.from_array(B, "B"), numpy_helper.from_array(scales, "scales")])
            y = sess.run(None, {"x": np.eye(K, dtype=np.float32)})[0]
            wq = dequantize_matmul(B, scales, K, bits, block)
            assert wq.shape == (K, 7) and wq.dtype == np.float32
            np.testing.assert_allclose(y, wq, rtol=1e-6, atol=1e-30, err_msg=f"block {block} K {K}")
            # round to nearest: off by half a step, a whole one where +|extreme| is clamped to 2^bits - 1
            step = np.repeat(np.abs(scales).T, block, axis=0)[:K]
            assert (np.abs(wq - w) <= step * (1 + 1e-6)).all()
            assert np.mean(np.abs(wq - w) <= step / 2 * (1 + 1e-6)) > 0.9


@pytest.mark.parametrize("block", [16, 32, 128])
def test_gather_block_quantized_returns_the_dequantized_rows(block):
    rng = np.random.default_rng(block)
    for V, d in ((7, 96), (9, 100), (5, 33), (8, 256)):
        table = rng.standard_normal((V, d)).astype(np.float32)
        t = gather_blocks(table, 4, block)
        node = helper.make_node("GatherBlockQuantized", ["data", "ids", "scales"], ["y"], domain="com.microsoft",
                                gather_axis=0, quantize_axis=1, block_size=block)
        sess = _session(node, [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, d])],
                        [data_tensor(t, "data"), scales_tensor(t, "scales")])
        ids = rng.permutation(V).astype(np.int64)
        e = dequantize_gather(t.data, t.scales, t.shape, block)
        np.testing.assert_array_equal(sess.run(None, {"ids": ids})[0], e[ids], err_msg=f"{V} x {d}")
        step = np.repeat(np.abs(t.scales), block, axis=1)[:, :d]
        assert (np.abs(e - table) <= step * (1 + 1e-6)).all()


# --- speed (printed) ----------------------------------------------------------------------------------

def test_speed_on_a_real_size_matrix(capsys):
    """matmul_blocks on Llama-3-8B's gate/up projection w [4096, 14336] fp32, int4 block 32, against the
    private binding (ONNX Runtime's own quantizer calls it) and against quantize_one_node; same bytes all three."""
    w = np.random.default_rng(0).standard_normal((4096, 14336)).astype(np.float32)
    times = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        times[name] = time.perf_counter() - t0
        return out

    B, scales = timed("export.rtn.matmul_blocks", lambda: matmul_blocks(w, 4, 32))
    try:
        from onnxruntime.capi._pybind_state import quantize_matmul_4bits
    except ImportError:
        quantize_matmul_4bits = None
    if quantize_matmul_4bits is not None:
        packed, s = np.zeros_like(B), np.zeros_like(scales)
        timed("private binding quantize_matmul_4bits",
              lambda: quantize_matmul_4bits(packed, w, s, np.zeros((14336, 64), np.uint8), 32, 14336, 4096, True))
        np.testing.assert_array_equal(packed, B)
        assert s.tobytes() == scales.tobytes()
    theirs = timed("quantize_one_node (public quantizer)",
                   lambda: quantize_one_node("MatMul", w, QuantConfig("int4", 32)))
    assert numpy_helper.to_array(theirs[1]).tobytes() == B.tobytes()
    with capsys.disabled():
        print("\n  int4 block 32, w [4096, 14336] fp32:")
        for name, t in times.items():
            print(f"    {name:40s} {t:6.2f} s")
