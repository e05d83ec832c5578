"""A stand-in for the `tensorrt` module: just the builder calls runtime.trt_engine makes, recording them.

It behaves as the TensorRT 11 documentation says the real one does where our code
depends on it: a new builder config has BuilderFlag.TF32 set (NvInfer.h: "Enabled by
default"), the parsed network has one KV_CACHE_UPDATE layer per TensorScatter, and
an engine reports the input each output aliases (get_aliased_input_tensor). It builds
nothing: the serialized "engine" is a marker string.
"""
from __future__ import annotations

import types


class _Layer:
    def __init__(self, kind):
        self.type = kind


def fake_tensorrt(kv_cache_layers: int, parse_errors=(), version: str = "11.0.0.0") -> types.ModuleType:
    """A module object to put into sys.modules["tensorrt"]; `.configs` collects every builder config."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.BuilderFlag = types.SimpleNamespace(TF32="TF32", VERSION_COMPATIBLE="VERSION_COMPATIBLE")
    trt.LayerType = types.SimpleNamespace(KV_CACHE_UPDATE="KV_CACHE_UPDATE", MATRIX_MULTIPLY="MATRIX_MULTIPLY")
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=1)
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
    trt.configs = []

    class Logger:
        WARNING = 2

        def __init__(self, level):
            self.level = level

    class Network:
        def __init__(self, flags):
            self.flags = flags
            self.layers = [_Layer("MATRIX_MULTIPLY")] + [_Layer("KV_CACHE_UPDATE")] * kv_cache_layers

        @property
        def num_layers(self):
            return len(self.layers)

        def get_layer(self, i):
            return self.layers[i]

    class TimingCache:
        def __init__(self, data):
            self.data = data

        def serialize(self):
            return b"timing"

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            self.shapes[name] = (lo, opt, hi)

    class Config:
        def __init__(self):
            self.flags = {"TF32"}
            self.profiles = []
            self.timing = None

        def set_flag(self, flag):
            self.flags.add(flag)

        def clear_flag(self, flag):
            self.flags.discard(flag)

        def set_memory_pool_limit(self, pool, size):
            self.workspace = size

        def create_timing_cache(self, data):
            return TimingCache(data)

        def set_timing_cache(self, cache, ignore_mismatch):
            self.timing = cache

        def get_timing_cache(self):
            return self.timing

        def add_optimization_profile(self, profile):
            self.profiles.append(profile.shapes)

    class Builder:
        def __init__(self, logger):
            self.logger = logger

        def create_network(self, flags):
            return Network(flags)

        def create_builder_config(self):
            config = Config()
            trt.configs.append(config)
            return config

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            return b"engine tf32=%d" % ("TF32" in config.flags)

    class OnnxParser:
        def __init__(self, network, logger):
            self.num_errors = len(parse_errors)

        def parse_from_file(self, path):
            return not parse_errors

        def get_error(self, i):
            return parse_errors[i]

    trt.Logger, trt.Builder, trt.OnnxParser = Logger, Builder, OnnxParser
    return trt


class FakeEngine:
    """get_aliased_input_tensor as ICudaEngine has it: output name -> input name or None."""

    def __init__(self, aliases: dict[str, str | None]):
        self.aliases = aliases

    def get_aliased_input_tensor(self, name):
        return self.aliases.get(name)
