"""Finding the files a backend runs (ONNX graph, tokenizer) and checking the graph's I/O contract.

    build/<name>/                 from export.build
        model.int4.onnx           a --quantize build's graph: what ONNX Runtime runs first (the user
        model.int8.onnx           built it to run it; MatMulNBits / QLinear ops are ONNX Runtime's)
        model.fused.onnx          what TensorRT runs, and ONNX Runtime without a quantized graph
        model.onnx                used when no fused graph exists
        tokenizer.json, config.json, report.json

--model may also name an .onnx file; its tokenizer.json is looked up beside it.
"""
from __future__ import annotations

from pathlib import Path

from core.build_files import FUSED, QUANTIZED, TOKENIZER, UNFUSED
from core.contract import ContractError, DecodeContract, contract_of, read_contract
from runtime.session import ModelFileError

ORT_ONLY_MARK = ("tapernorm.attention", "ort-gqa")       # graph_passes/ort_attention.py's model metadata
ORT_ONLY_GRAPH = ("ONNX Runtime's GroupQueryAttention (export.build --target ort-cpu, its default without "
                  "TensorRT: ONNX Runtime only)")
GENAI_SUFFIX = ".genai.onnx"                             # export/genai.py: GenAI's I/O, not our contract
BUILD_HINT = "build one with: python -m export.build --fuse --checkpoint CHECKPOINT --out DIR"


def resolve_onnx(path: str | Path, quantized_first: bool = False) -> Path:
    """The graph to run: PATH itself if it is a file, else in PATH: model.fused.onnx, else model.onnx, else a
    quantized graph (all a streamed quantized build holds). quantized_first (ONNX Runtime): a quantized graph
    before the others, so that a `--quantize int4` build runs int4 without naming the file."""
    path = Path(path)
    if path.is_file() and path.name.endswith(GENAI_SUFFIX):
        raise ModelFileError(f"{path}: expected a graph with this project's decode contract, found ONNX Runtime "
                             f"GenAI's (input_ids, attention_mask, past_key_values.*); pass the build directory "
                             f"{path.parent}, or run this one with og.Model('{path.parent}')")
    if path.is_file():
        return path
    if path.is_dir():
        for name in (*QUANTIZED, FUSED, UNFUSED) if quantized_first else (FUSED, UNFUSED, *QUANTIZED):
            if (path / name).is_file():
                return path / name
        raise ModelFileError(f"{path}: expected a build directory with {FUSED}, {UNFUSED} or {' or '.join(QUANTIZED)}, "
                             f"found none; {BUILD_HINT}")
    raise ModelFileError(f"{path}: expected a build directory or an .onnx file, found nothing there; {BUILD_HINT}")


def is_ort_only(path: Path) -> bool:
    """Whether the graph is ONNX Runtime's GroupQueryAttention one (export.build --target ort-cpu, its
    default where TensorRT is not installed), from the mark graph_passes/ort_attention.py leaves in it;
    False for a file onnx cannot read (the backend's own load then says so in its words)."""
    import onnx
    try:
        meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    except Exception:
        return False
    return meta.get(ORT_ONLY_MARK[0]) == ORT_ONLY_MARK[1]


def load_tokenizer(path: str | Path, vocab_size: int | None = None):
    """The model's tokenizer.json, in the build/checkpoint directory or beside an .onnx file; with
    vocab_size, refuse one whose ids would not index the logits."""
    from tokenizers import Tokenizer
    from core.errors import first_line
    path = Path(path)
    where = (path.parent if path.is_file() else path) / TOKENIZER
    if not where.is_file():
        raise ModelFileError(f"{where}: expected the model's tokenizer, found no file; copy the checkpoint's {TOKENIZER} there")
    try:
        tok = Tokenizer.from_file(str(where))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ModelFileError(f"{where}: expected a tokenizers JSON file, found an unreadable one "
                             f"({first_line(e)}); copy the checkpoint's {TOKENIZER} again") from None
    n = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and n > vocab_size:
        raise ModelFileError(f"{where}: has {n} tokens, the model's logits cover {vocab_size}; "
                             "use the tokenizer the model was built with")
    return tok


def spec_from_ort_session(session, where) -> DecodeContract:
    """The decode contract of a loaded onnxruntime.InferenceSession; ModelFileError if its I/O is not one.
    An input with a default (logits_from) is one of the session's overridable initializers, not its inputs."""
    inputs = [*session.get_inputs(), *session.get_overridable_initializers()]
    try:
        return read_contract(where, {i.name: (i.shape, i.type) for i in inputs},
                             {o.name: (o.shape, o.type) for o in session.get_outputs()})
    except ContractError as e:
        raise ModelFileError(str(e)) from None


def spec_from_onnx_file(path: Path) -> DecodeContract:
    """The decode contract read with the onnx package (no runtime needed; weights not loaded)."""
    try:
        return contract_of(Path(path))
    except ContractError as e:
        raise ModelFileError(str(e)) from None
