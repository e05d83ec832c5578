"""export/emit.py against its oracle, export_onnx: the emitted graph computes what torch's graph computes
and the graph passes fold it as they fold torch's.

For each model (random configs covering every DecoderConfig feature and norm kind / gate, the zoo, every
Hugging Face family of tests/hf_models.py) and attention form:
  - the same decode-step contract, metadata, opset, cache writes and explicit Squeeze axes;
  - on export.verify sessions (random tokens, two sequences at different cache slots; same start for
    gqa), every output of every step equal within fp32 1e-6 (fp16: export.verify's fp16 tolerance);
  - run_passes(passes_for(form)) on both: the same (pass, where) folded and skipped (fold_constants
    aside: torch's graph holds a tied head as Transpose(table), folded by it; the emitted graph holds
    the transposed table itself and has nothing to fold), or the same refusal, and equal outputs after.
The default run keeps one case per feature group (each random config combines many features, one
zoo model, one Hugging Face family); `-m slow` runs the whole sweep. torch.onnx.export is the slow
part (3-10 s a model here), so each export is made once per session (_EXPORTS).
"""
from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from export.emit import emit_graph
from models.weights import model_weights as ModelWeights
from tests.export.oracle import export_onnx
from export.verify import compare, interface_mismatches, ort_session, read_interface, run_onnx, session_steps
from graph_passes import passes_for, run_passes
from graph_passes.base import PassError
from graph_passes.lazy import is_placeholder, materialized
from models.decoder import Decoder, DecoderConfig
from tests.helpers import random_model
from tests.hf_models import FAMILIES

ZOO = Path(os.environ.get("TAPERNORM_ZOO", Path(__file__).resolve().parents[2] / "models" / "zoo"))

ATOL_EMIT_FP32 = 1e-6       # the same ops on the same constants: ONNX Runtime computes both graphs alike
ROPE = dict(pos_embedding="rope")
# One config per feature group; together they cover every DecoderConfig field, norm kind and gate.
CASES = {
    # rope (yarn, a local base on the sliding layer, NoPE), GQA, per-head QK-norm, sandwich norms, every
    # Gemma / Granite scale and soft-cap, all-taper affine at g = 0, untied, no biases, swiglu
    "rope-kitchen": dict(n_layer=3, n_kv_head=2, mlp="swiglu", norm="taper", taper_scope="all", taper_affine=True,
                         gate=0.0, tie_embeddings=False, qkv_bias=False, mlp_bias=False, qk_norm="head",
                         norm_layout="sandwich", sliding_window=3, sliding_layers=[1], local_rope_theta=100.0,
                         nope_layers=[2], attn_softcap=3.0, final_softcap=5.0, attn_scale=0.3, embed_scale=2.0,
                         residual_scale=0.5, logits_divisor=3.0,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
                         **ROPE),
    # GPT-2: learned positions, LayerNorm, erf GELU, biases, tied; post norms, a projection QK-norm and
    # disabled norms (eps 1e12, FakeLN)
    "learned-ln-post": dict(norm="layernorm", activation="gelu", norm_layout="post", qk_norm="proj",
                            layer_eps={"blocks.0.post_attn_norm": 1e12, "ln_f": 1e12}),
    # Phi-3: partial rotary with longrope past its switch, MQA, relu; a TaperNorm blend (LN base, gate 0.4);
    # no final norm
    "partial-longrope-blend": dict(n_kv_head=1, head_size=8, rotary_dim=4, activation="relu", norm="taper",
                                   taper_scope="internal", taper_base="ln", gate=0.4, final_norm=False,
                                   rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5],
                                                 "long_factor": [2.0, 4.0], "factor": 4.0,
                                                 "original_max_position_embeddings": 5}, **ROPE),
    # DyT (its QK-norms too), llama3 rope, GQA in the plain form's 5-D views, no final norm (the default run:
    # DyT by the zoo's model, llama3 and GQA by Hugging Face's llama-bias-llama3)
    "dyt-llama3-gqa": dict(norm="dyt", qk_norm="head", n_kv_head=2, final_norm=False,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, **ROPE),
    # taper at g = 1 (RMS base, affine), linear rope scaling, a real RMSNorm final norm (internal scope);
    # in the default run as fp16
    "taper1-linear": dict(norm="taper", taper_scope="internal", taper_affine=True, gate=1.0, n_kv_head=2,
                          rope_scaling={"rope_type": "linear", "factor": 2.0}, **ROPE),
    # the rest of the sweep (slow): single features on their own
    "baseline": dict(),
    "internal-taper": dict(norm="taper", taper_scope="internal", gate=0.0),
    "all-taper-ln-affine-swiglu-untied": dict(norm="taper", taper_scope="all", taper_base="ln", taper_affine=True,
                                              mlp="swiglu", tie_embeddings=False, gate=0.0),
    "taper-blend-rms-affine": dict(norm="taper", taper_scope="all", taper_affine=True, gate=0.3),
    "taper1-ln": dict(norm="taper", taper_scope="all", taper_base="ln", gate=1.0),
    "qwen3-gqa-head16": dict(norm="taper", taper_scope="internal", gate=0.0, qk_norm="head", head_size=16,
                             n_kv_head=2, qkv_bias=False, out_bias=False, mlp_bias=False, **ROPE),
    "olmo2-all-taper": dict(norm="taper", taper_scope="all", gate=0.0, norm_layout="post", qk_norm="proj",
                            n_kv_head=2, **ROPE),
    "gemma2": dict(norm_layout="sandwich", attn_scale=0.3, attn_softcap=3.0, final_softcap=5.0, sliding_window=3,
                   sliding_layers=[0], embed_scale=4.0, **ROPE),
    "longrope-full-rotary": dict(head_size=8, rope_scaling={"rope_type": "longrope", "factor": 4.0,
                                                            "short_factor": [1.0, 1.5, 1.2, 1.1],
                                                            "long_factor": [2.0, 4.0, 3.0, 5.0],
                                                            "original_max_position_embeddings": 5}, **ROPE),
    "granite-swiglu": dict(embed_scale=2.0, attn_scale=0.2, residual_scale=0.5, logits_divisor=3.0, mlp="swiglu",
                           **ROPE),
    "dyt-learned": dict(norm="dyt"),
}
DEFAULT = {"rope-kitchen": ("fused",), "learned-ln-post": ("plain",), "partial-longrope-blend": ("plain",)}
FP16 = ("taper1-linear", "rope-kitchen", "learned-ln-post", "qwen3-gqa-head16")     # the first in the default run
ZOO_DEFAULT, HF_DEFAULT = ("dyt", "fused"), ("llama-bias-llama3", "plain")         # DyT; GQA's 5-D plain views
# ops that compute (not views, shapes or masks): both graphs have the same number of each
MATH_OPS = ("MatMul", "Gemm", "Add", "Sub", "Mul", "Div", "Neg", "Tanh", "Gelu", "Relu", "Sigmoid", "Softmax",
            "Where", "Cos", "Sin", "RMSNormalization", "LayerNormalization", "Attention", "TensorScatter", "Gather",
            "ReduceMax")

_EXPORTS: dict = {}


def torch_graph(key, model, dtype="fp32", attention="plain"):
    """export_onnx's graph of `model`, exported once per session."""
    if (key, dtype, attention) not in _EXPORTS:
        _EXPORTS[key, dtype, attention] = export_onnx(model, None, dtype, attention)
    return _EXPORTS[key, dtype, attention]


def random_case(name: str):
    return random_model(seed=len(name), **CASES[name])


def _outputs(proto, same_start=False):
    """Every output of every step, two sessions (past a sliding window of 3 and longrope's switch at 5)."""
    iface = read_interface(proto)
    sess = ort_session(proto)
    return [run_onnx(sess, iface, session_steps(iface, seed=s, prompt=6, decode=4, same_start=same_start))
            for s in (0, 1)]


def assert_same_outputs(ref, got, dtype, what):
    for r, g in zip(ref, got):
        if dtype == "fp32":
            for step, (rs, gs) in enumerate(zip(r, g)):
                assert rs.keys() == gs.keys()
                for name in rs:
                    np.testing.assert_allclose(gs[name], rs[name], atol=ATOL_EMIT_FP32, rtol=0,
                                               err_msg=f"{what}: {name}, step {step}")
        else:
            compare(r, g, dtype, what)            # raises VerificationError beyond ATOL / SCALE_TOL[dtype]


def pass_results(proto, form, lazy=None):
    """(folded (pass, where) without fold_constants, skipped (pass, where), fold_constants folds, fused graph);
    a refusal: (the error's line, None, None, None). With `lazy` (the graph's Lazies), the fused graph comes
    materialized."""
    lazy = None if lazy is None else dict(lazy)
    try:
        fused, results = run_passes(proto, passes_for(form), lazy=lazy)
    except PassError as e:
        return str(e), None, None, None
    folded = [(r.name, f.where) for r in results for f in r.folded if r.name != "fold_constants"]
    skipped = [(r.name, f.where) for r in results for f in r.skipped]
    constants = [f.where for r in results if r.name == "fold_constants" for f in r.folded]
    return folded, skipped, constants, fused if lazy is None else materialized(fused, lazy)


def _math_ops(proto) -> Counter:
    return Counter(n.op_type for n in proto.graph.node if n.op_type in MATH_OPS)


def check_structure(mine, ref, cfg):
    """The same contract, metadata and computing ops as torch's graph; explicit Squeeze axes, one in-place
    TensorScatter per cache, Attention without its optional outputs."""
    assert not interface_mismatches(read_interface(mine), read_interface(ref))
    assert read_interface(mine) == read_interface(ref)
    assert [(p.key, p.value) for p in mine.metadata_props] == [(p.key, p.value) for p in ref.metadata_props]
    assert [(o.domain, o.version) for o in mine.opset_import] == [("", 24)]
    g = mine.graph
    assert all(len(n.input) == 2 for n in g.node if n.op_type == "Squeeze"), "a Squeeze without axes"
    writes = [n for n in g.node if n.op_type == "TensorScatter"]
    inputs, outputs = {i.name for i in g.input}, {o.name for o in g.output}
    assert len(writes) == 2 * cfg.n_layer
    for n in writes:
        attrs = {a.name: (a.i if a.type == a.INT else a.s) for a in n.attribute}
        assert attrs == {"axis": -2, "mode": b"linear"} and n.input[0] in inputs and n.output[0] in outputs
    assert all(len(n.output) == 1 for n in g.node if n.op_type == "Attention")
    assert _math_ops(mine) == _math_ops(ref)


def check_against_export(key, model, attention, dtype="fp32", lazy_route=False):
    """The emitted graph of `model` against export_onnx's: structure, outputs, pass results. With lazy_route,
    the passes also run on the emitted graph as the build runs them, its matrices unread (run_passes' lazy):
    the same results, and the same outputs once the folded Lazies are computed."""
    emitted = emit_graph(ModelWeights(model), dtype, attention)
    mine, ref = materialized(emitted.proto, emitted.lazy), torch_graph(key, model, dtype, attention)
    check_structure(mine, ref, model.cfg)
    assert_same_outputs(_outputs(ref), _outputs(mine), dtype, f"{key} {dtype} {attention}")
    for form in ("plain",) if attention == "plain" else ("fused", "gqa"):
        r, m = pass_results(ref, form), pass_results(mine, form)
        assert m[:2] == r[:2], f"{key} {form}: passes differ"
        if m[3] is None:
            continue
        assert m[2] == [], f"{key}: the emitted graph left constants to fold: {m[2]}"
        if form == "gqa" and dtype != "fp32":
            continue        # ONNX Runtime's CPU GroupQueryAttention is fp32 only (and ort_gqa types its packed
            #                 QKV MatMul fp32 whatever the graph's dtype: such a graph does not load on the CPU)
        same = form == "gqa"          # ONNX Runtime's GQA: batched prefills from slot 0
        folded = _outputs(m[3], same)
        assert_same_outputs(_outputs(r[3], same), folded, dtype, f"{key} {form} after the passes")
        if lazy_route:
            lz = pass_results(emitted.proto, form, emitted.lazy)
            assert lz[:3] == m[:3], f"{key} {form}: the passes differ on the unread graph"
            assert_same_outputs(folded, _outputs(lz[3], same), dtype, f"{key} {form} folded unread")
    return emitted


# --- random configs -----------------------------------------------------------------------------

@pytest.mark.parametrize("name, attention", [(n, a) for n, forms in DEFAULT.items() for a in forms])
def test_emitted_equals_export(name, attention):
    check_against_export(name, random_case(name), attention, lazy_route=True)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["plain", "fused"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_emitted_equals_export_sweep(name, attention):
    check_against_export(name, random_case(name), attention)


def test_fp16_equals_export():
    check_against_export(FP16[0], random_case(FP16[0]), "plain", "fp16")


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["plain", "fused"])
@pytest.mark.parametrize("name", FP16)
def test_fp16_equals_export_sweep(name, attention):
    check_against_export(name, random_case(name), attention, "fp16")


def test_bf16_is_the_fp16_graph_retyped_with_each_weight_rounded_once_and_runs_widened():
    """bf16: the fp16 emission's structure with every fp16 type bf16 (export.bfloat16.bf16_graph, after the
    passes), its weights rounded to bf16 once from fp32 (the rope frequencies kept fp32); widened, it computes
    the fp32 export's outputs within export.verify's bf16 tolerance (bf16 weights, fp32 arithmetic)."""
    import ml_dtypes
    from onnx import TensorProto
    from export.bfloat16 import bf16_graph, retype, widen
    name = "learned-ln-post"
    model = random_case(name)
    bf16, fp16 = emit_graph(ModelWeights(model), "bf16"), emit_graph(ModelWeights(model), "fp16")
    bf16_graph(bf16.proto, bf16.lazy, bf16.fp32)
    expected = retype(fp16.proto)
    for p in expected.metadata_props:
        if p.key == "tapernorm.dtype":
            p.value = "bf16"
    structure = lambda m: [(n.op_type, list(n.input), list(n.output), [a.SerializeToString() for a in n.attribute])
                           for n in m.graph.node]
    assert structure(bf16.proto) == structure(expected)
    assert [(t.name, t.data_type, list(t.dims)) for t in bf16.proto.graph.initializer] == \
        [(t.name, t.data_type, list(t.dims)) for t in expected.graph.initializer]
    assert bf16.lazy.keys() == fp16.lazy.keys()
    params = dict(model.named_parameters())
    for k, lazy in bf16.lazy.items():
        assert lazy.dtype == np.dtype(ml_dtypes.bfloat16) and lazy.shape == fp16.lazy[k].shape
        exact = params[lazy.key[0]].detach().numpy()          # the fp32 weight, rounded once
        value = lazy.load()
        assert np.array_equal(value, (exact.T if "T" in lazy.key else exact).astype(ml_dtypes.bfloat16))
    assert all(t.data_type != TensorProto.FLOAT16 for t in bf16.proto.graph.initializer)
    widened = widen(materialized(bf16.proto, bf16.lazy))
    ref = torch_graph(name, model)
    for r, g in zip(_outputs(ref), _outputs(widened)):
        compare(r, g, "bf16", f"{name} bf16 widened vs fp32 export")


# --- the zoo and the Hugging Face families ----------------------------------------------------------

def _zoo(name):
    ckpt = ZOO / name
    if not (ckpt / "config.json").is_file():
        pytest.skip(f"zoo model {name!r} is absent ({ckpt})")
    return ckpt


def _zoo_names():
    return sorted(p.name for p in ZOO.iterdir() if (p / "config.json").is_file()) if ZOO.is_dir() else []


def test_zoo_model_equals_export():
    from models.checkpoint import load_checkpoint
    name, attention = ZOO_DEFAULT
    check_against_export(f"zoo:{name}", load_checkpoint(_zoo(name)), attention)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["plain", "fused"])
@pytest.mark.parametrize("name", _zoo_names())
def test_zoo_sweep(name, attention):
    from models.checkpoint import load_checkpoint
    check_against_export(f"zoo:{name}", load_checkpoint(_zoo(name)), attention)


def _hf_converted(name, folder):
    from models.convert import convert
    from tests.hf_models import hf_model, save_hf
    save_hf(hf_model(name), folder)
    return convert(folder).model


def test_hf_family_equals_export(tmp_path):
    name, attention = HF_DEFAULT
    check_against_export(f"hf:{name}", _hf_converted(name, tmp_path / name), attention)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["plain", "fused"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_hf_sweep(name, attention, tmp_path):
    check_against_export(f"hf:{name}", _hf_converted(name, tmp_path / name), attention)


def test_weight_sources_give_the_same_graph(tmp_path):
    """open_weights (our checkpoint, a Hugging Face folder: tensors read from the files when a matrix is
    written) and ModelWeights (the model in memory) emit the same graph with the same values."""
    from models.checkpoint import load_checkpoint
    from models.weights import open_weights
    folder = tmp_path / "qwen3"
    hf = _hf_converted("qwen3", folder)
    zoo = _zoo("qwen3-all-taper")
    for where, model in ((zoo, load_checkpoint(zoo)), (folder, hf)):
        a, b = emit_graph(open_weights(where), "fp16", "fused"), emit_graph(ModelWeights(model), "fp16", "fused")
        assert a.proto.SerializeToString() == b.proto.SerializeToString(), where
        assert materialized(a.proto, a.lazy).SerializeToString() == materialized(b.proto, b.lazy).SerializeToString()


# --- what the emitter reads, and how fast -------------------------------------------------------------

class NoMatrices:
    """A source over a skeleton whose tensor() refuses every 2-D parameter (and serves 1-D ones as ones)."""

    def __init__(self, skeleton: Decoder):
        self.cfg, self.skeleton = skeleton.cfg, skeleton
        self.shapes = {n: tuple(p.shape) for n, p in skeleton.named_parameters(remove_duplicate=False)}

    def tensor(self, name):
        if len(self.shapes[name]) >= 2:
            raise AssertionError(f"emit_graph read the matrix {name}")
        return torch.ones(self.shapes[name])


def _lazy_matrices(emitted) -> dict[str, tuple]:
    """Placeholder name -> key, after checking every placeholder has its Lazy of the same dtype and dims."""
    from onnx import helper
    out = {}
    for t in emitted.proto.graph.initializer:
        if is_placeholder(t):
            lazy = emitted.lazy[t.name]
            assert list(t.dims) == list(lazy.shape) and helper.tensor_dtype_to_np_dtype(t.data_type) == lazy.dtype
            out[t.name] = lazy.key
    assert out.keys() == emitted.lazy.keys()
    return out


@pytest.mark.parametrize("name", ["rope-kitchen", "learned-ln-post"])
def test_no_matrix_is_read(name):
    """Every 2-D parameter becomes a Lazy (MatMul weights transposed, the tables as stored); a tied head is
    the embedding's Lazy transposed (its key the table's + ("T",)); nothing 2-D is read."""
    model = random_case(name)
    keys = _lazy_matrices(emit_graph(NoMatrices(model), "fp16", "plain"))
    matrices = {n for n, p in model.named_parameters() if p.dim() == 2}
    linears = {n for n in matrices if n not in ("wte.weight", "wpe.weight", "lm_head.weight")}
    assert {keys[n.replace(".weight", ".MatMul.weight")] for n in linears} == {(n, "fp16", "T") for n in linears}
    assert keys["wte.weight"] == ("wte.weight", "fp16")
    head = ("wte.weight" if model.cfg.tie_embeddings else "lm_head.weight", "fp16", "T")
    assert keys["lm_head.MatMul.weight"] == head
    assert ("wpe.weight" in keys) == (model.cfg.pos_embedding == "learned")
    source = ModelWeights(model)
    for lazy in emit_graph(source, "fp16", "plain").lazy.values():     # each reads its tensor, transposes, casts
        expected = source.tensor(lazy.key[0]).numpy().astype(np.float16)
        np.testing.assert_array_equal(lazy.load(), expected.T if lazy.key[-1] == "T" else expected)


LLAMA3_8B = DecoderConfig(vocab_size=128256, d_model=4096, n_layer=32, n_head=32, n_kv_head=8, mlp="swiglu",
                          mlp_hidden=14336, max_seq_len=8192, pos_embedding="rope", rope_theta=500000.0,
                          norm="rmsnorm", tie_embeddings=False, qkv_bias=False, out_bias=False, mlp_bias=False,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def test_llama3_8b_shape_emits_without_reading_a_matrix(capsys):
    """The Llama-3-8B shape on the meta device: every matrix a Lazy, nothing 2-D read; the time is printed
    (a benchmark's number, not asserted: shared machines are noisy)."""
    with torch.device("meta"):
        skeleton = Decoder(LLAMA3_8B)
    emit_graph(NoMatrices(skeleton), "fp16", "fused")               # warm: imports, first-call costs
    start = time.perf_counter()
    emitted = emit_graph(NoMatrices(skeleton), "fp16", "fused")
    seconds = time.perf_counter() - start
    keys = _lazy_matrices(emitted)
    assert len(keys) == 32 * 7 + 2
    weight_bytes = sum(lazy.nbytes for lazy in emitted.lazy.values())
    assert weight_bytes == 2 * sum(p.numel() for p in skeleton.parameters() if p.dim() == 2)
    assert emitted.proto.ByteSize() < 4 << 20, "the graph without its matrices should be small"
    with capsys.disabled():
        print(f"\nemit_graph, Llama-3-8B shape (fp16, fused): {seconds:.3f} s, {len(emitted.proto.graph.node)} nodes, "
              f"{emitted.proto.ByteSize() / 1e6:.2f} MB of graph, {weight_bytes / 1e9:.1f} GB of lazy matrices")


def test_bad_arguments():
    model = random_case("baseline")
    with pytest.raises(ValueError, match="dtype"):
        emit_graph(ModelWeights(model), "int8")
    with pytest.raises(ValueError, match="attention"):
        emit_graph(ModelWeights(model), "fp32", "gqa")
