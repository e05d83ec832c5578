"""Real model shapes as Hugging Face config dicts, and random-init folders of them written tensor
by tensor, without ever building the model.

    write_random_folder("llama-3-8b", "work/llama-3-8b")     # 16 GB of bf16 in 2 GiB shards

The folder is what `save_pretrained` writes (config.json; model.safetensors, or shards
model-0000i-of-0000n.safetensors with model.safetensors.index.json), so transformers,
models.convert, export.build and GenAI's model builder read it like a downloaded model. Every
tensor comes from its own seeded generator (seed, tensor name): normal(0, 0.02) for matrices
and embeddings, 1 for norm weights, 0 for biases, drawn directly in the folder's dtype; one
shard's tensors are alive at a time, so memory peaks at about one shard. Speed does not depend
on the values; conversion and export read every tensor, so the sizes are real.
"""
from __future__ import annotations

import json
import math
import time
import zlib
from pathlib import Path

from core.errors import INT32_MAX, UserError
from core.inputs import check_memory
from core.outputs import SCALE_FOLDER, check_output_dir, output_dir, writing

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", attention_bias=False,
              mlp_bias=False, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001, vocab_size=128256,
              rope_theta=500000.0, initializer_range=0.02)
_GPT2 = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], activation_function="gelu_new",
             layer_norm_epsilon=1e-5, vocab_size=50257, n_positions=1024, n_ctx=1024, tie_word_embeddings=True,
             bos_token_id=50256, eos_token_id=50256, initializer_range=0.02)

_QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_act="silu", head_dim=128,
              vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
              attention_bias=False, use_sliding_window=False, bos_token_id=151643, eos_token_id=151645,
              initializer_range=0.02)
_GEMMA3 = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_activation="gelu_pytorch_tanh",
               head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
               query_pre_attn_scalar=256, sliding_window_pattern=6, tie_word_embeddings=True, attention_bias=False,
               final_logit_softcapping=None, attn_logit_softcapping=None, bos_token_id=2, eos_token_id=1,
               pad_token_id=0, initializer_range=0.02)

SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(_LLAMA, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, intermediate_size=8192, tie_word_embeddings=True, rope_scaling=_LLAMA3_ROPE,
                         max_position_embeddings=131072),
    "llama-3.2-3b": dict(_LLAMA, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         head_dim=128, intermediate_size=8192, tie_word_embeddings=True, rope_scaling=_LLAMA3_ROPE,
                         max_position_embeddings=131072),
    "llama-3-8b": dict(_LLAMA, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, intermediate_size=14336, tie_word_embeddings=False, max_position_embeddings=8192),
    "qwen2.5-0.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu", hidden_size=896,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                         vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, use_sliding_window=False, sliding_window=32768,
                         max_window_layers=24, bos_token_id=151643, eos_token_id=151643, initializer_range=0.02),
    "gpt2-medium": dict(_GPT2, n_embd=1024, n_layer=24, n_head=16),
    "gpt2-xl": dict(_GPT2, n_embd=1600, n_layer=48, n_head=25),
    # the 2026 families (issue 34): their published config.json sizes; rope factors of Phi-4-mini's longrope
    # are of the right length (48), not its published values (the cache's default capacity never reaches them)
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       intermediate_size=6144, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=9728, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=12288, tie_word_embeddings=False),
    "gemma-3-1b": dict(_GEMMA3, hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                       intermediate_size=6912, vocab_size=262144, sliding_window=512, max_position_embeddings=32768),
    "gemma-3-4b": dict(_GEMMA3, hidden_size=2560, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=10240, vocab_size=262208, sliding_window=1024, max_position_embeddings=131072,
                       rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "phi-4-mini": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_act="silu", hidden_size=3072,
                       num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192,
                       vocab_size=200064, tie_word_embeddings=True, rms_norm_eps=1e-5, partial_rotary_factor=0.75,
                       max_position_embeddings=131072, original_max_position_embeddings=4096, rope_theta=10000.0,
                       rope_scaling={"type": "longrope", "short_factor": [1.0] * 48,
                                     "long_factor": [1.0 + i / 8 for i in range(48)]},
                       bos_token_id=199999, eos_token_id=199999, pad_token_id=199999, initializer_range=0.02),
    "smollm3-3b": dict(model_type="smollm3", architectures=["SmolLM3ForCausalLM"], hidden_act="silu", hidden_size=2048,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4, intermediate_size=11008,
                       vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=5000000.0,
                       max_position_embeddings=65536, no_rope_layer_interval=4, use_sliding_window=False,
                       bos_token_id=128000, eos_token_id=128012, pad_token_id=128004, initializer_range=0.02),
    "olmo-2-1b": dict(model_type="olmo2", architectures=["Olmo2ForCausalLM"], hidden_act="silu", hidden_size=2048,
                      num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, intermediate_size=8192,
                      vocab_size=100352, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=500000.0,
                      max_position_embeddings=4096, attention_bias=False, bos_token_id=100257, eos_token_id=100257,
                      pad_token_id=100277, initializer_range=0.02),
}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}      # --dtype -> torch / config name
STD = 0.02


# the sizes a folder's tensors are made of: (required, optional) config keys, each a positive integer
SIZE_KEYS = {"gpt2": (("n_embd", "n_layer", "n_head", "vocab_size", "n_positions"), ("n_inner",)),
             "llama": (("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"),
                       ("num_key_value_heads", "head_dim"))}


def check_sizes(where: str, config: dict) -> None:
    """Refuse (one line) a config whose sizes cannot make tensors: missing, not an integer, < 1, or past
    INT32_MAX (what a dimension of ONNX Runtime's and GenAI's kernels holds)."""
    required, optional = SIZE_KEYS["gpt2" if config.get("model_type") == "gpt2" else "llama"]
    for key in required + optional:
        value = config.get(key)
        if value is None and key in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= INT32_MAX:
            found = "no such key" if key not in config else f"{value!r}"
            raise UserError(f"{where}: {key}: expected an integer in [1, {INT32_MAX}], found {found}; fix the config")


def resolve_shape(shape: str | dict) -> tuple[str, dict]:
    """(name, config) of a SHAPES name, a path to a config .json file, or a config dict (its sizes checked)."""
    if isinstance(shape, dict):
        name = shape.get("_name_or_path") or shape["model_type"]
        check_sizes(f"shape {name}", shape)
        return name, dict(shape)
    if shape in SHAPES:
        return shape, dict(SHAPES[shape])
    if shape.endswith(".json"):
        try:
            config = json.loads(Path(shape).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"{shape}: expected a readable JSON config, found {type(e).__name__}: {e}; "
                            "fix the file or pass a shape name") from None
        from models.families import SUPPORTED
        if not isinstance(config, dict) or config.get("model_type") not in SUPPORTED:
            raise UserError(f"{shape}: expected a config with model_type one of {', '.join(SUPPORTED)}, found "
                            f"{config.get('model_type') if isinstance(config, dict) else type(config).__name__!r}; "
                            "fix the file")
        check_sizes(shape, config)
        return Path(shape).stem, config
    raise UserError(f"shape {shape!r}: expected one of {', '.join(SHAPES)} or a config .json path, found neither; "
                    "pick one")


def folder_config(config: dict, dtype: str = "bf16", layers: int | None = None) -> dict:
    """config.json of the folder: the shape with its dtype and (for tests) a layer count."""
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}; pick one")
    out = {k: v for k, v in config.items() if k != "_name_or_path"}
    out["torch_dtype"] = DTYPES[dtype]
    if layers is not None:
        out["n_layer" if out["model_type"] == "gpt2" else "num_hidden_layers"] = layers
    return out


def tensor_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every stored tensor, from the family's layout (models/hf_layout.py: the names
    and shapes the converter expects of a folder of this config); init: normal | ones | zeros. A unit norm gain is
    ones, or zeros in a family that stores w for 1 + w (Gemma)."""
    from models.convert import ConvertError, hf_stored_tensors, stores_gain_minus_one
    try:
        stored = hf_stored_tensors(config, f"shape {config.get('model_type')}")
    except ConvertError as e:
        raise UserError(str(e)) from None
    unit = "zeros" if stores_gain_minus_one(config["model_type"]) else "ones"
    gpt2 = config["model_type"] == "gpt2"

    def init(name: str, shape) -> str:
        if name.endswith(".bias"):
            return "zeros"
        is_norm = len(shape) == 1 and ("norm" in name or (gpt2 and ".ln_" in name))
        return unit if is_norm else "normal"
    return [(name, shape, init(name, shape)) for name, shape in stored]


def human(n: float, unit: str = "") -> str:
    """1.24 B / 90.4 M / 512 k with unit "" (parameters); 16.1 GB / 3.52 MB / 12.0 kB with unit "B" (10^3 steps)."""
    for div, prefix in ((1e9, " G" if unit else " B"), (1e6, " M"), (1e3, " k")):
        if abs(n) >= div * 0.9995:       # 999.9 M prints as 1 B, not as 1e+03 M
            return f"{n / div:.3g}{prefix}{unit}"
    return f"{n:.0f}{' ' + unit if unit else ''}"


def plan_shards(specs, itemsize: int, shard_bytes: int) -> list[list[tuple]]:
    """Tensors grouped in order into shards of at most shard_bytes (a larger tensor gets a shard of its own)."""
    shards, size = [[]], 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def random_tensor(name: str, shape, init: str, seed: int, dtype):
    """One tensor, the same for a given (seed, name) whatever the shard layout."""
    import torch
    if init == "ones":
        return torch.ones(shape, dtype=dtype)
    if init == "zeros":
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator().manual_seed((seed << 32) + zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=dtype).normal_(0.0, STD, generator=g)


def write_random_folder(shape_name_or_config: str | dict, out_dir, seed: int = 0, dtype: str = "bf16",
                        shard_bytes: int = 2 << 30, layers: int | None = None, log=print) -> Path:
    """Write a random-init Hugging Face folder of the shape at out_dir (atomically); returns out_dir."""
    import torch
    from safetensors.torch import save_file
    name, config = resolve_shape(shape_name_or_config)
    config = folder_config(config, dtype, layers)
    torch_dtype = getattr(torch, DTYPES[dtype])
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    specs = tensor_specs(config)
    shards = plan_shards(specs, itemsize, shard_bytes)
    total = sum(math.prod(s) for _, s, _ in specs) * itemsize
    marker = {"shape": name, "seed": seed, "dtype": dtype, "config": config}
    check_output_dir(out_dir, SCALE_FOLDER)         # before the line below says what it is about to write
    # one shard's tensors are alive at a time: refuse (one line) a shard that cannot be, before writing
    peak, big = max((sum(math.prod(s) for _, s, _ in shard) * itemsize, shard[0]) for shard in shards)
    check_memory(peak, f"{name}: a {human(peak, 'B')} shard (from tensor {big[0]} {list(big[1])})",
                 "use smaller sizes or a smaller --shard-gb")
    log(f"{name}: {human(sum(math.prod(s) for _, s, _ in specs))} parameters, {human(total, 'B')} {dtype} "
        f"in {len(shards)} shard(s) -> {out_dir}")
    with output_dir(out_dir, SCALE_FOLDER, marker=marker) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        weight_map, written = {}, 0
        for i, shard in enumerate(shards, 1):
            t0 = time.perf_counter()
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            tensors = {n: random_tensor(n, s, init, seed, torch_dtype) for n, s, init in shard}
            with writing(tmp / fname):             # safetensors' errors name no file
                save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            nbytes = sum(t.numel() for t in tensors.values()) * itemsize
            del tensors
            weight_map.update({n: fname for n, _, _ in shard})
            written += nbytes
            log(f"  shard {i}/{len(shards)} {fname}: {len(shard)} tensors, {human(nbytes, 'B')} "
                f"({human(written, 'B')} of {human(total, 'B')}) in {time.perf_counter() - t0:.1f} s")
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return Path(out_dir)


def folder_matches(folder, shape_name_or_config, seed: int = 0, dtype: str = "bf16", layers: int | None = None) -> bool:
    """True when folder is a finished write_random_folder of exactly this shape, seed and dtype."""
    from core.outputs import read_marker
    name, config = resolve_shape(shape_name_or_config)
    marker = read_marker(Path(folder)) or {}
    return (marker.get("kind") == SCALE_FOLDER.name and marker.get("seed") == seed and marker.get("dtype") == dtype
            and marker.get("config") == json.loads(json.dumps(folder_config(config, dtype, layers))))
