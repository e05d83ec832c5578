"""Finding the files a backend runs (ONNX graph, tokenizer) and checking the graph's I/O contract.

    build/<name>/                 from export.build
        model.fused.onnx          preferred by the ort and trt backends
        model.onnx                used when no fused graph exists
        tokenizer.json, config.json, report.json

--model may also name an .onnx file; its tokenizer.json is looked up beside it.
"""
from __future__ import annotations

from pathlib import Path

from runtime.session import ModelFileError, ModelSpec

FUSED, UNFUSED, TOKENIZER = "model.fused.onnx", "model.onnx", "tokenizer.json"
BUILD_HINT = "build one with: python -m export.build --fuse --checkpoint CHECKPOINT --out DIR"
ONNX_DTYPES = {"tensor(float)": "fp32", "tensor(float16)": "fp16", 1: "fp32", 10: "fp16"}


def resolve_onnx(path: str | Path) -> Path:
    """The graph to run: PATH itself if it is a file, else PATH/model.fused.onnx, else PATH/model.onnx."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        for name in (FUSED, UNFUSED):
            if (path / name).is_file():
                return path / name
        raise ModelFileError(f"{path}: expected a build directory with {FUSED} or {UNFUSED}, found neither; {BUILD_HINT}")
    raise ModelFileError(f"{path}: expected a build directory or an .onnx file, found nothing there; {BUILD_HINT}")


def resolve_tokenizer(path: str | Path) -> Path:
    """tokenizer.json in the build/checkpoint directory, or beside an .onnx file."""
    path = Path(path)
    where = (path.parent if path.is_file() else path) / TOKENIZER
    if not where.is_file():
        raise ModelFileError(f"{where}: expected the model's tokenizer, found no file; copy the checkpoint's {TOKENIZER} there")
    return where


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer
    where = resolve_tokenizer(path)
    try:
        return Tokenizer.from_file(str(where))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ModelFileError(f"{where}: expected a tokenizers JSON file, found an unreadable one "
                             f"({str(e).splitlines()[0]}); copy the checkpoint's {TOKENIZER} again") from None


def spec_from_io(where, inputs: dict[str, tuple[list, str]], outputs: dict[str, tuple[list, str]]) -> ModelSpec:
    """ModelSpec from the graph's I/O: name -> (shape with str/None for dynamic axes, element type).

    Checks the contract names (input_ids, position, key_i/value_i, logits, present_*);
    the metadata props are descriptive, the I/O is what actually runs.
    """
    def fail(expected: str, found: str):
        raise ModelFileError(f"{where}: expected {expected}, found {found}; re-export with python -m export.build")

    for name in ("input_ids", "position"):
        if name not in inputs:
            fail(f"a decode-step graph with input {name!r}", f"inputs {sorted(inputs)}")
    if "logits" not in outputs:
        fail("output 'logits'", f"outputs {sorted(outputs)}")
    n_layer = sum(1 for n in inputs if n.startswith("key_"))
    if n_layer == 0:
        fail("cache inputs key_0, value_0, ...", f"inputs {sorted(inputs)}")
    for i in range(n_layer):
        for n in (f"key_{i}", f"value_{i}"):
            if n not in inputs or f"present_{n}" not in outputs:
                fail(f"input {n} and output present_{n}", f"inputs {sorted(inputs)}, outputs {sorted(outputs)}")
    shape, etype = inputs["key_0"]
    if len(shape) != 4 or not all(isinstance(d, int) for d in shape[1:]):
        fail("key_0 of shape [batch, H, S_max, D] with static H, S_max, D", f"{shape}")
    vocab = outputs["logits"][0][-1]
    if not isinstance(vocab, int):
        fail("logits with a static vocabulary axis", f"{outputs['logits'][0]}")
    if etype not in ONNX_DTYPES:
        fail("fp32 or fp16 caches", f"{etype}")
    _, h, s, d = shape
    return ModelSpec(n_layer=n_layer, n_head=h, head_dim=d, capacity=s, vocab_size=vocab, dtype=ONNX_DTYPES[etype])


def spec_from_onnx_file(path: Path) -> ModelSpec:
    """ModelSpec read with the onnx package (no runtime needed; weights not loaded)."""
    import onnx
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # DecodeError, OSError, ...
        raise ModelFileError(f"{path}: expected an ONNX model, found an unreadable file ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                             "re-run python -m export.build") from None

    def io(values):
        out = {}
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
            out[v.name] = (dims, t.elem_type)
        return out
    return spec_from_io(path, io(proto.graph.input), io(proto.graph.output))
