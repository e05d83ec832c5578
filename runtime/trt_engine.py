"""A TensorRT 11 engine from the decode-step ONNX graph: profiles, cache keys, build, reuse.

    EngineFromOnnx(onnx_path, BuildOptions(max_batch=8))()  ->  serialized engine bytes

Precision comes from the ONNX tensor dtypes: every TensorRT 11 network is strongly
typed (the FP16/BF16 builder flags are gone), so an fp16 graph gives an fp16 engine
and an fp32 graph an fp32 one; norms kept in fp32 by explicit casts stay fp32.
One precision flag is left: TF32, which TensorRT enables by default (NvInfer.h:
"kTF32 ... Enabled by default") and which rounds fp32 matmul inputs to 10-bit
mantissas. BuildOptions.tf32 defaults to False here, so an fp32 engine computes what
ONNX Runtime's CPU provider computes (the parity tests' atol 1e-3 then means
something); tf32=True is an opt-in for speed. It is part of the cache key.

The KV cache: key_i / value_i are engine inputs with a static [.., S_max, D] shape,
written by the parser's lowering of TensorScatter (IKVCacheUpdateLayer, whose
output present_key_i must share its input's device address). The runtime binds
one buffer to both names (`io_mapping().aliases`), so a step updates it in place;
after deserializing it checks that the engine itself aliases each present_* to
its cache input (ICudaEngine.get_aliased_input_tensor, TensorRT >= 10.15), which
is true only where the parser made a KV-cache update layer of the TensorScatter.

Two optimization profiles (min / opt / max per dynamic axis):

    profile 0  decode   input_ids [1..max_batch, 1]           caches [1..max_batch, H, S_max, D]
    profile 1  prefill  input_ids [1..max_batch, 1..max_prompt]

Next to the ONNX file the builder leaves

    <stem>.<key>.engine       the serialized engine; <key> hashes everything it depends on:
                              ONNX bytes, TensorRT version, GPU name and compute capability,
                              profiles and build options; an unchanged key reuses the file
    <stem>.<key>.engine.json  what built it (TensorRT version, GPU, options, TF32, version
                              compatibility): a plan loads only in the TensorRT version that
                              built it unless built version-compatible (Triton reads this too)
    timing.<gpu>.cache        the timing cache, read before and written after every build

Both are written to a temporary file and renamed into place.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from core.contract import INPUT_IDS, POSITION, DecodeContract, io_names, present_name
from core.outputs import replace_file_in
from runtime.session import ModelFileError, RuntimeUserError

ENGINE_FORMAT = 2          # bump when the way engines are built changes (2: TF32 off unless asked)
DECODE_PROFILE, PREFILL_PROFILE = 0, 1

Shape = tuple[int, ...]
ProfileShapes = dict[str, tuple[Shape, Shape, Shape]]   # input name -> (min, opt, max)


class EngineBuildError(RuntimeUserError):
    """TensorRT could not parse or build the graph; the message lists the parser errors."""


@dataclass(frozen=True)
class BuildOptions:
    max_batch: int = 8
    opt_batch: int = 1
    max_prompt: int | None = None        # default: the cache capacity
    opt_prompt: int | None = None        # default: min(128, max_prompt)
    workspace_mib: int | None = None     # default: TensorRT's (the device memory)
    optimization_level: int | None = None  # builder_optimization_level 0..5; default TensorRT's (3)
    tf32: bool = False                   # TF32 matmuls for fp32 tensors (TensorRT's default is on)
    version_compatible: bool = False     # BuilderFlag.VERSION_COMPATIBLE: the plan carries a lean runtime
                                         # and loads in later TensorRT versions (host code must be allowed)

    def resolved(self, spec: DecodeContract) -> "BuildOptions":
        max_prompt = self.max_prompt or spec.capacity
        opt_prompt = self.opt_prompt or min(128, max_prompt)
        for name, v, hi in (("max_batch", self.max_batch, None), ("opt_batch", self.opt_batch, self.max_batch),
                            ("max_prompt", max_prompt, spec.capacity), ("opt_prompt", opt_prompt, max_prompt)):
            if v < 1 or (hi is not None and v > hi):
                raise ValueError(f"BuildOptions.{name} is {v}; expected 1.." + (str(hi) if hi else "n"))
        return replace(self, max_prompt=max_prompt, opt_prompt=opt_prompt)


def profile_shapes(spec: DecodeContract, options: BuildOptions) -> list[ProfileShapes]:
    """[decode profile, prefill profile]: min / opt / max shape of every engine input."""
    o = options.resolved(spec)

    def profile(seq: tuple[int, int, int]) -> ProfileShapes:
        batch = (1, o.opt_batch, o.max_batch)
        return {INPUT_IDS: tuple(zip(batch, seq)), POSITION: tuple((b,) for b in batch),
                **{name: tuple(spec.cache_shape(b) for b in batch) for name in spec.cache_names()}}
    return [profile((1, 1, 1)), profile((1, o.opt_prompt, o.max_prompt))]


@dataclass(frozen=True)
class EngineIO:
    """Engine tensor names and which output shares its buffer with which input."""
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    aliases: dict[str, str]      # present_key_i -> key_i, present_value_i -> value_i


def io_mapping(spec: DecodeContract) -> EngineIO:
    inputs, outputs = io_names(spec.n_layer)
    return EngineIO(tuple(inputs), tuple(outputs), aliases={present_name(n): n for n in spec.cache_names()})


def check_engine_io(engine_names: dict[str, str], spec: DecodeContract, where) -> None:
    """engine_names: tensor name -> 'input' | 'output'; raise if it is not the contract."""
    io = io_mapping(spec)
    expected = {**{n: "input" for n in io.inputs}, **{n: "output" for n in io.outputs}}
    if engine_names != expected:
        missing = sorted(set(expected) - set(engine_names))
        extra = sorted(set(engine_names) - set(expected))
        wrong = sorted(n for n in set(expected) & set(engine_names) if expected[n] != engine_names[n])
        raise ModelFileError(f"{where}: expected the decode-step I/O, found missing {missing}, unexpected {extra}, "
                             f"wrong direction {wrong}; delete the engine to rebuild it")


def check_aliases(engine, spec: DecodeContract, where) -> None:
    """Raise ModelFileError unless the engine aliases every present_* output to its cache input.

    `engine` is an ICudaEngine (or anything with get_aliased_input_tensor(name) -> str | None).
    IKVCacheUpdateLayer writes in place, so TensorRT requires the output and the cache
    input to share one device address; the session binds them so. An engine that does
    not report the alias computed present_* some other way (a copy), and binding one
    buffer to both would then read and write it at once.
    """
    get = getattr(engine, "get_aliased_input_tensor", None)
    if get is None:
        raise ModelFileError(f"{where}: expected a TensorRT with ICudaEngine.get_aliased_input_tensor (>= 10.15, the "
                             "KV-cache update layer), found an older one; pip install 'tapernorm-deploy[tensorrt]'")
    wrong = {out: get(out) for out, src in io_mapping(spec).aliases.items() if get(out) != src}
    if wrong:
        first = next(iter(wrong))
        raise ModelFileError(f"{where}: expected each present_* output to alias its cache input (TensorRT's in-place "
                             f"KV-cache update), found {len(wrong)} that do not ({first} -> {wrong[first]}); export "
                             "with TensorScatter on axis -2 (python -m export.build) and delete the engine to rebuild")


def file_digest(path: Path) -> str:
    """sha256 of the ONNX file and of its external-data file (<name>.data) if there is one."""
    h = hashlib.sha256()
    for p in (path, path.with_name(path.name + ".data")):
        if p.is_file():
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def device_tag(name: str, capability: tuple[int, int]) -> str:
    """'NVIDIA H200' (9, 0) -> 'nvidia-h200-sm90': safe in a file name."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return f"{slug}-sm{capability[0]}{capability[1]}"


def engine_cache_key(onnx_digest: str, trt_version: str, device: str, spec: DecodeContract, options: BuildOptions) -> str:
    """16 hex digits; changes whenever anything the engine depends on changes."""
    payload = {"format": ENGINE_FORMAT, "onnx": onnx_digest, "tensorrt": trt_version, "device": device,
               "spec": asdict(spec),
               "options": asdict(options.resolved(spec)),
               "profiles": [{k: [list(s) for s in v] for k, v in p.items()} for p in profile_shapes(spec, options)]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def engine_path(onnx_path: Path, key: str) -> Path:
    return onnx_path.with_name(f"{onnx_path.stem}.{key}.engine")


def engine_info_path(engine: Path) -> Path:
    return engine.with_name(engine.name + ".json")


# A serialized TensorRT engine (a plan, what IBuilder.build_serialized_network returns) starts with this
# tag; torch-tensorrt tells a raw plan from its own wrappers by it. Reading it needs no TensorRT.
PLAN_TAG = b"ftrt"


def plan_problem(path: Path) -> str | None:
    """What `path` is instead of a serialized TensorRT engine (None: it starts with PLAN_TAG). Only the
    tag is read: without TensorRT (and a GPU) a plan cannot be deserialized, so a damaged one passes."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        return f"an unreadable file ({e.strerror or e})"
    if head.startswith(PLAN_TAG):
        return None
    text = head.lstrip()
    kind = ("JSON text" if text[:1] in (b"{", b"[") else "an empty file" if not head
            else "text" if all(32 <= b < 127 or b in b"\t\r\n" for b in head) else "other bytes")
    return f"{kind} (it starts {head[:8]!r}, not TensorRT's plan tag {PLAN_TAG!r})"


def read_engine_info(engine: Path) -> dict | None:
    """The build record written beside an engine, or None where there is none (or it is unreadable)."""
    try:
        info = json.loads(engine_info_path(engine).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def timing_cache_path(onnx_path: Path, device: str) -> Path:
    return onnx_path.with_name(f"timing.{device}.cache")


def set_flag(trt, config, name: str, on: bool) -> None:
    """Set or clear BuilderFlag `name`; a flag this TensorRT does not have can only be off."""
    flag = getattr(trt.BuilderFlag, name, None)
    if flag is None:
        if on:
            raise EngineBuildError(f"BuildOptions: expected a TensorRT with BuilderFlag.{name}, found "
                                   f"TensorRT {trt.__version__} without it; leave that option off")
        return
    (config.set_flag if on else config.clear_flag)(flag)


def cuda_device_tag() -> str:
    import torch
    i = torch.cuda.current_device()
    return device_tag(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))


class EngineFromOnnx:
    """Loader (Polygraphy naming): serialized engine bytes for an ONNX file, built once, then reused.

    Needs tensorrt and a CUDA device. After a call, `.path` is the engine file and
    `.built` says whether this call built it (False: loaded from the cache).
    """

    def __init__(self, onnx_path: str | Path, spec: DecodeContract, options: BuildOptions = BuildOptions(),
                 rebuild: bool = False):
        self.onnx_path = Path(onnx_path)
        self.spec = spec
        self.options = options.resolved(spec)
        self.rebuild = rebuild
        self.path: Path | None = None
        self.built = False
        self.key: str | None = None
        self.tensorrt_version: str | None = None
        self.kv_cache_layers: int | None = None   # counted in the parsed network (a reused engine: its record)

    def __call__(self) -> bytes:
        import tensorrt as trt
        device = cuda_device_tag()
        key = engine_cache_key(file_digest(self.onnx_path), trt.__version__, device, self.spec, self.options)
        self.key, self.tensorrt_version = key, trt.__version__
        self.path = engine_path(self.onnx_path, key)
        if self.path.is_file() and not self.rebuild:
            self.built = False
            self.kv_cache_layers = (read_engine_info(self.path) or {}).get("kv_cache_layers")   # as counted at build
            return self.path.read_bytes()
        data = self._build(trt, timing_cache_path(self.onnx_path, device))
        replace_file_in(self.path.parent, self.path.name, data)
        self.built = True
        info = {**self.report(), "device": device, "onnx": self.onnx_path.name, "options": asdict(self.options)}
        replace_file_in(self.path.parent, engine_info_path(self.path).name, json.dumps(info, indent=2) + "\n")
        return data

    def report(self) -> dict:
        """What the last call used and did (for logs and gpu_check): path, key, built, precision flags."""
        return {"engine": str(self.path), "key": self.key, "built": self.built, "tensorrt": self.tensorrt_version,
                "tf32": self.options.tf32, "version_compatible": self.options.version_compatible,
                "kv_cache_layers": self.kv_cache_layers}

    def _build(self, trt, timing_path: Path) -> bytes:
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        # TensorRT 11 networks are always strongly typed; name the flag where the enum still has it
        strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
        network = builder.create_network(0 if strongly_typed is None else 1 << int(strongly_typed))
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(self.onnx_path)):
            errors = "; ".join(str(parser.get_error(i)).strip() for i in range(parser.num_errors))
            raise EngineBuildError(f"{self.onnx_path}: expected a graph the TensorRT ONNX parser accepts, found errors: "
                                   f"{errors}; run the TensorRT lint in graph_passes or use --backend ort")
        kv_update = getattr(trt.LayerType, "KV_CACHE_UPDATE", None)      # None: this TensorRT has no such layer type
        self.kv_cache_layers = None if kv_update is None else sum(
            1 for i in range(network.num_layers) if network.get_layer(i).type == kv_update)
        expected = len(self.spec.cache_names())
        if self.kv_cache_layers is not None and self.kv_cache_layers != expected:
            raise EngineBuildError(f"{self.onnx_path}: expected {expected} KV-cache update layers (one per cache; the "
                                   f"parser's lowering of TensorScatter), found {self.kv_cache_layers}; export with "
                                   "TensorScatter 4-D on axis -2 (python -m export.build), or use --backend ort")
        config = builder.create_builder_config()
        if self.options.workspace_mib:
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, self.options.workspace_mib << 20)
        if self.options.optimization_level is not None:
            config.builder_optimization_level = self.options.optimization_level
        set_flag(trt, config, "TF32", self.options.tf32)
        if self.options.version_compatible:
            set_flag(trt, config, "VERSION_COMPATIBLE", True)
        timing = config.create_timing_cache(timing_path.read_bytes() if timing_path.is_file() else b"")
        config.set_timing_cache(timing, ignore_mismatch=False)
        for shapes in profile_shapes(self.spec, self.options):
            profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in shapes.items():
                profile.set_shape(name, lo, opt, hi)
            config.add_optimization_profile(profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise EngineBuildError(f"{self.onnx_path}: expected TensorRT to build an engine, found a failed build "
                                   "(see the TensorRT log above); try a smaller --max-batch or the ort backend")
        replace_file_in(timing_path.parent, timing_path.name, bytes(config.get_timing_cache().serialize()))
        return bytes(serialized)


class EngineFromFile:
    """Loader of an engine built elsewhere (a Triton repository's model.plan): read, never built.

    Its build record (<engine>.json) gives the options it was built with, where there is one;
    the session reads the profiles' limits from the engine itself.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.built = False
        self.info = read_engine_info(self.path) or {}

    def options(self) -> BuildOptions:
        """The BuildOptions of its record (defaults where it has none)."""
        recorded = self.info.get("options") or {}
        known = BuildOptions.__dataclass_fields__
        return BuildOptions(**{k: v for k, v in recorded.items() if k in known})

    def __call__(self) -> bytes:
        try:
            return self.path.read_bytes()
        except OSError as e:
            raise ModelFileError(f"{self.path}: expected a serialized TensorRT engine, found it unreadable "
                                 f"({e.strerror}); write the repository again with its engine") from None
