"""The ONNX Runtime GenAI folder of a build: `export.build --fuse --genai [--quantize int4]`.

GenAI's model builder cannot fold a TaperNorm, DyT or LN-free model; this writes our folded
graph in the form GenAI loads as it is (what its builder writes for a Llama, checked with
`python -m onnxruntime_genai.models.builder -p int4 -e cpu` on 0.18):

    genai_config.json        model.decoder.{filename, inputs, outputs, heads, layers}, search options
    model.genai.onnx         input_ids [batch_size, sequence_length], attention_mask [batch_size,
                             total_sequence_length], past_key_values.N.key|value [batch_size, H,
                             past_sequence_length, D] -> logits, present.N.key|value; GroupQueryAttention
                             reads the past and writes the present in one buffer (past_present_share_buffer)
    tokenizer.json           (copied by the build) and tokenizer_config.json (the HF folder's own
                             tokenizer files, or one written for ours), what GenAI's og.Tokenizer reads

The graph is our GroupQueryAttention graph (--attention gqa: graph_passes/ort_attention.py) with
its I/O renamed; its weights are not touched. Our `position` input (the first cache slot of the
step, per sequence) becomes a value computed from the mask, as GenAI's own graphs derive their lengths:

    position = ReduceSum(attention_mask[:, :total_sequence_length - sequence_length], axis 1)   # [B]: the past length

the real tokens before the step's. GenAI right-pads a batch's prompts (pad ids, mask 0); a padded row's
prefill then starts at 0 (ReduceSum(attention_mask) - sequence_length would be negative there) and its
decode steps at its own length, the slot GroupQueryAttention writes (seqlens_k = position + S - 1).

With weights in a .data file (large models) the GenAI graph names the same file: a second view
of the same weights costs no disk (core.onnx_writer.save_onnx keeps external tensors in their file).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from core.errors import UserError

GENAI_GRAPH, GENAI_CONFIG = "model.genai.onnx", "genai_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# HF tokenizer files GenAI's tokenizer (onnxruntime-extensions) may read, copied from an HF folder that has them
HF_TOKENIZER_FILES = (TOKENIZER_CONFIG, "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                      "tokenizer.model", "generation_config.json")
EOS_TEXT = "<|endoftext|>"       # the end-of-text token of the project's tokenizers (train/tokenizer.py)
PAST, PRESENT = "past_key_values.{}.{}", "present.{}.{}"
# The GenAI graph against the graph it came from: the same ops on the same weights, only the cache
# buffer length (capacity vs the tokens so far) and where `position` comes from differ, so logits
# agree to float rounding of GroupQueryAttention over a different buffer (measured 0 on the zoo).
GENAI_ATOL = 1e-5


class GenAIError(UserError):
    """A graph that cannot become GenAI's; the message is one line for the user."""


# --- the graph ---------------------------------------------------------------------------------

def _cache_renames(proto) -> dict[str, str]:
    """key_i -> past_key_values.i.key, present_key_i -> present.i.key, ... for every layer."""
    from core.contract import CACHE_KINDS, CACHE_PREFIX, cache_name, present_name
    names = {i.name for i in proto.graph.input}
    n_layer = sum(1 for n in names if n.startswith(CACHE_PREFIX))
    renames = {}
    for i in range(n_layer):
        for kv in CACHE_KINDS:
            renames[cache_name(i, kv)] = PAST.format(i, kv)
            renames[present_name(cache_name(i, kv))] = PRESENT.format(i, kv)
    return renames


def check_gqa_graph(proto, where) -> None:
    """Refuse a graph GenAI could not run with a shared cache buffer: ours, with every cache read and
    written by ONNX Runtime's GroupQueryAttention (which writes in place at the right slots)."""
    from core.contract import PRESENT_PREFIX, contract_of
    contract_of(proto, where)          # our decode contract, or one line saying what is off
    readers = {x for n in proto.graph.node if n.op_type == "GroupQueryAttention" for x in n.input}
    writers = {x for n in proto.graph.node if n.op_type == "GroupQueryAttention" for x in n.output}
    renames = _cache_renames(proto)
    bad = [n for n in renames if n not in (writers if n.startswith(PRESENT_PREFIX) else readers)]
    others = [x for n in proto.graph.node if n.op_type != "GroupQueryAttention" for x in n.input if x in renames]
    if bad or others:
        raise GenAIError(f"{where}: expected every cache read and written by GroupQueryAttention (a --attention gqa "
                         f"graph), found {(bad or others)[0]} handled by other ops; build with --attention gqa")


def _batch_from_input_ids(proto) -> None:
    """Shape(cache)[0:1], the batch size as torch's exporter may read it off a cache input, read off
    input_ids instead: the same number, and then GroupQueryAttention alone reads the caches."""
    from core.contract import INPUT_IDS
    caches = set(_cache_renames(proto))
    for node in proto.graph.node:
        attrs = {a.name: a.i for a in node.attribute}
        if node.op_type == "Shape" and node.input[0] in caches and attrs.get("start") == 0 and attrs.get("end") == 1:
            node.input[0] = INPUT_IDS


def genai_graph(proto, where="graph"):
    """Our GroupQueryAttention graph (weights loaded or not) with GenAI's I/O, edited in place; returns it."""
    from onnx import TensorProto, helper
    from core.contract import INPUT_IDS, LOGITS, LOGITS_FROM, POSITION
    _batch_from_input_ids(proto)
    check_gqa_graph(proto, where)
    g, renames = proto.graph, _cache_renames(proto)
    for node in g.node:
        node.input[:] = [renames.get(x, x) for x in node.input]
        node.output[:] = [renames.get(x, x) for x in node.output]
    kept = [v for v in g.value_info if v.name not in renames]      # their static capacity no longer holds
    del g.value_info[:]
    g.value_info.extend(kept)
    for v in (*g.input, *g.output):
        dims = v.type.tensor_type.shape.dim
        if v.name in renames:
            v.name = renames[v.name]
            dims[2].dim_param = "past_sequence_length" if v.name.startswith("past") else "total_sequence_length"
        if v.name in (INPUT_IDS, LOGITS, *renames.values()):
            dims[0].dim_param = "batch_size"       # (setting dim_param clears a static dim_value)
        if v.name in (INPUT_IDS, LOGITS):
            dims[1].dim_param = "sequence_length"
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])
    # position becomes the mask's sum below; logits_from is no input of GenAI's: its initializer (0: every
    # position's logits, which GenAI's own graphs compute) stays as a constant
    inputs = [v for v in g.input if v.name not in (POSITION, LOGITS_FROM)]
    del g.input[:]
    g.input.extend([inputs[0], mask, *inputs[1:]] if inputs[0].name == INPUT_IDS else [mask, *inputs])
    g.initializer.extend([helper.make_tensor("genai_axis_1", TensorProto.INT64, [1], [1]),
                          helper.make_tensor("genai_zero", TensorProto.INT64, [1], [0])])
    # position [B] = the real tokens before this step: the mask summed over its columns before the step's
    # S (the last S columns). Not ReduceSum(mask) - S: GenAI right-pads a batch's prompts (mask 1 1 1 0 0 0),
    # which makes that negative at a padded row's prefill, and `position` also indexes the positional
    # embedding (a Gather wraps a negative index). GroupQueryAttention's lengths (ort_attention.py: seqlens_k =
    # position + S - 1, total = max(position) + S) are then GenAI's graphs' own but at a padded row's prefill,
    # where seqlens_k also covers the pads: causal, the real tokens never see them, and decode overwrites them.
    nodes = [helper.make_node("Shape", ["attention_mask"], ["genai_total_length"], "genai_total_length",
                              start=1, end=2),
             helper.make_node("Shape", [INPUT_IDS], ["genai_step_length"], "genai_step_length", start=1, end=2),
             helper.make_node("Sub", ["genai_total_length", "genai_step_length"], ["genai_past_length"],
                              "genai_past_length"),
             helper.make_node("Slice", ["attention_mask", "genai_zero", "genai_past_length", "genai_axis_1"],
                              ["genai_past_mask"], "genai_past_mask"),
             helper.make_node("ReduceSum", ["genai_past_mask", "genai_axis_1"], [POSITION], "genai_position",
                              keepdims=0)]
    old = list(g.node)
    del g.node[:]
    g.node.extend(nodes + old)
    proto.metadata_props.add(key="tapernorm.io", value="onnxruntime-genai")
    return proto        # (checked by running it: verify_genai; onnx.checker would need the weights beside it)


# --- genai_config.json and the tokenizer ------------------------------------------------------------

def genai_config(cfg, filename: str, token_ids: dict) -> dict:
    """genai_config.json for a models.decoder.DecoderConfig, in the layout GenAI's builder writes.
    type "llama": GenAI's plain decoder-only loop (input_ids, attention_mask, a KV cache); positions,
    norms and the head are inside our graph, so nothing else of the architecture is read from it."""
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": filename, "head_size": cfg.head_dim, "hidden_size": cfg.d_model,
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                   "past_key_names": PAST.format("%d", "key"), "past_value_names": PAST.format("%d", "value")},
        "outputs": {"logits": "logits", "present_key_names": PRESENT.format("%d", "key"),
                    "present_value_names": PRESENT.format("%d", "value")},
        "num_attention_heads": cfg.n_head, "num_hidden_layers": cfg.n_layer, "num_key_value_heads": cfg.kv_heads,
    }
    search = {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
              "max_length": cfg.max_seq_len, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
              "num_return_sequences": 1, "past_present_share_buffer": True, "repetition_penalty": 1.0,
              "temperature": 1.0, "top_k": 50, "top_p": 1.0}
    model = {**token_ids, "context_length": cfg.max_seq_len, "decoder": decoder, "type": "llama",
             "vocab_size": cfg.vocab_size}
    return {"model": dict(sorted(model.items())), "search": search}


def special_token_ids(checkpoint: Path, tokenizer: Path | None, vocab_size: int) -> tuple[dict, list[str]]:
    """bos / eos / pad token ids (an HF folder's config.json, else the tokenizer's <|endoftext|>, else 0)
    and notes on ids replaced: GenAI refuses an id outside [0, vocab_size) (a GPT-2 config's 50256
    over a smaller vocabulary)."""
    hf = checkpoint / "config.json"
    raw = json.loads(hf.read_text()) if hf.is_file() else {}
    eos = None
    if tokenizer is not None:
        from tokenizers import Tokenizer
        eos = Tokenizer.from_file(str(tokenizer)).token_to_id(EOS_TEXT)
    fallback = eos if eos is not None and 0 <= eos < vocab_size else 0
    ids, notes = {}, []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = raw.get(key)
        found = [v] if isinstance(v, int) else [x for x in v if isinstance(x, int)] if isinstance(v, list) else []
        kept = [x for x in found if 0 <= x < vocab_size]
        if len(kept) < len(found):
            notes.append(f"{key} {v} of {hf} is outside the vocabulary of {vocab_size}; genai_config.json has "
                         f"{kept[0] if kept else fallback}")
        ids[key] = (kept[0] if len(kept) == 1 else kept) if kept else fallback
    return ids, notes


# The JSON types GenAI's tokenizer (onnxruntime-extensions, GenAI 0.18) requires of tokenizer_config.json's keys,
# as measured: another type made og.Tokenizer fail on the finished folder ("type must be string, but is number").
_TOKEN = (str, dict)                # "<s>", or {"content": "<s>", ...}
TOKENIZER_CONFIG_TYPES = {"tokenizer_class": (str,), "chat_template": (str, list), "model_max_length": (int, float),
                          "clean_up_tokenization_spaces": (bool,), "bos_token": _TOKEN, "eos_token": _TOKEN,
                          "unk_token": _TOKEN, "added_tokens_decoder": (dict,)}
JSON_TYPE = {str: "a string", dict: "an object", list: "a list", int: "a number", float: "a number",
             bool: "true or false"}


def check_tokenizer_files(checkpoint: Path) -> None:
    """Refuse (one line, before any work) an HF tokenizer file --genai would copy for GenAI's tokenizer that it
    cannot read: not JSON, not a JSON object, or a tokenizer_config.json key of the wrong type. The build
    copied them as they were and GenAI's tokenizer failed to load the finished folder."""
    from core.inputs import read_json_file
    fix = "fix the file, or move it out of the checkpoint (a tokenizer_config.json is then written for tokenizer.json)"
    if not (checkpoint / "tokenizer.json").is_file():      # (without one, none of them is copied)
        return
    for name in HF_TOKENIZER_FILES:
        path = checkpoint / name
        if not name.endswith(".json") or not path.is_file():
            continue
        data = read_json_file(path, "--genai: the tokenizer file")
        if not isinstance(data, dict):
            raise GenAIError(f"{path}: expected a JSON object (GenAI's tokenizer reads it), found "
                             f"{JSON_TYPE.get(type(data), type(data).__name__)}; {fix}")
        if name != TOKENIZER_CONFIG:
            continue
        for key, types in TOKENIZER_CONFIG_TYPES.items():
            value = data.get(key)
            wrong = value is not None and (not isinstance(value, types)
                                           or (isinstance(value, bool) and bool not in types))     # True is an int
            if key == "added_tokens_decoder" and not wrong and value is not None:
                wrong = not all(isinstance(v, dict) for v in value.values())
            if wrong:
                want = " or ".join(dict.fromkeys(JSON_TYPE[t] for t in types))
                want += " of objects" if key == "added_tokens_decoder" else ""
                raise GenAIError(f"{path}: {key}: expected {want} (GenAI's tokenizer reads it), found "
                                 f"{json.dumps(value)[:60]}; {fix}")


def write_tokenizer_files(checkpoint: Path, tokenizer: Path | None, out: Path, capacity: int) -> list[str]:
    """The tokenizer files besides tokenizer.json (which the build copies) GenAI reads: an HF folder's
    own, else a tokenizer_config.json for ours (a plain tokenizers file, <|endoftext|> its eos).
    Returns the names written; none without a tokenizer (GenAI then takes token ids only)."""
    if tokenizer is None:
        return []
    written = []
    if tokenizer.parent == checkpoint:
        for name in HF_TOKENIZER_FILES:
            if (checkpoint / name).is_file():
                shutil.copyfile(checkpoint / name, out / name)
                written.append(name)
    if TOKENIZER_CONFIG not in written:
        (out / TOKENIZER_CONFIG).write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS_TEXT, "eos_token": EOS_TEXT,
             "model_max_length": capacity}, indent=2) + "\n")
        written.append(TOKENIZER_CONFIG)
    return written


# --- the stage: write and verify -------------------------------------------------------------------

@dataclass
class GenAIFolder:
    """What the build report records of GenAI's folder (report.json's "genai"): the files written and the
    GenAI graph's check against the graph it came from."""
    graph: str                      # model.genai.onnx
    source: str                     # the build's graph it was made from (report.json: "from")
    config: str                     # genai_config.json
    tokenizer_files: list[str]
    token_ids: dict
    tokenizer: bool                 # whether the checkpoint had a tokenizer.json
    notes: list[str]
    logits_max_abs_diff: float = 0.0
    atol: float = GENAI_ATOL

    def to_json(self) -> dict:
        return {"graph": self.graph, "from": self.source, "config": self.config,
                "tokenizer_files": self.tokenizer_files, "token_ids": self.token_ids, "tokenizer": self.tokenizer,
                "notes": self.notes, "logits_max_abs_diff": self.logits_max_abs_diff, "atol": self.atol}


def write_genai(folder: Path, source: str, cfg, checkpoint: Path, tokenizer: Path | None) -> GenAIFolder:
    """Into `folder` (the build's temporary folder): model.genai.onnx from the graph file `source`
    there (its weights shared when external), genai_config.json and the tokenizer files.
    Returns what the report records."""
    from core.contract import load_onnx
    from core.onnx_writer import save_onnx
    from core.outputs import sign_onnx
    proto = load_onnx(folder / source, load_weights=False, what="the graph the GenAI graph is made from")
    save_onnx(sign_onnx(genai_graph(proto, folder / source)), folder / GENAI_GRAPH)
    del proto
    token_ids, notes = special_token_ids(checkpoint, tokenizer, cfg.vocab_size)
    (folder / GENAI_CONFIG).write_text(json.dumps(genai_config(cfg, GENAI_GRAPH, token_ids), indent=4) + "\n")
    files = write_tokenizer_files(checkpoint, tokenizer, folder, cfg.max_seq_len)
    return GenAIFolder(GENAI_GRAPH, source, GENAI_CONFIG, files, token_ids, tokenizer is not None, notes)


def verify_genai(folder: Path, source: str, tokens: list[int] | None) -> float:
    """The GenAI graph against the graph it came from, in ONNX Runtime (one session at a time):
    prefill + one-token steps on random and real tokens, batch 2 from slot 0; the logits of every
    step within GENAI_ATOL (export.verify.VerificationError otherwise). Returns the max |d logits|."""
    from core.contract import LOGITS
    from core.decode import token_steps
    from export.conventions import detect, run_onnx
    from export.verify import compare_sessions, ort_session, read_interface
    iface = read_interface(_structure(folder / source), source)
    genai = detect(_structure(folder / GENAI_GRAPH), GENAI_GRAPH)
    plans = genai.sessions(tokens=tokens)
    sess = ort_session(folder / source)          # the same tokens from slot 0, driven by core.decode; logits kept
    ours = [[{LOGITS: r[LOGITS]} for r in run_onnx(sess, iface, token_steps(plan.ids, plan.prompt))]
            for _, plan in plans]
    del sess
    sess = ort_session(folder / GENAI_GRAPH)
    theirs = [[{LOGITS: r[LOGITS]} for r in genai.run(sess, plan)] for _, plan in plans]
    del sess
    results = compare_sessions(plans, ours, theirs, "fp32", f"{GENAI_GRAPH} vs {source}", atol=GENAI_ATOL)
    return max(c.max_abs_diff["logits"] for c in results)


def _structure(path: Path):
    import onnx
    return onnx.load(str(path), load_external_data=False)


def genai_stage(folder: Path, source: str, cfg, checkpoint: Path, tokenizer: Path | None,
                tokens: list[int] | None) -> GenAIFolder:
    """write_genai, then verify_genai: what the build report records under "genai"."""
    info = write_genai(folder, source, cfg, checkpoint, tokenizer)
    info.logits_max_abs_diff = verify_genai(folder, source, tokens)
    return info
