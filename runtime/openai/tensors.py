"""The generate model's LLM tensor contract as the OpenAI server sends it: the names are
runtime/triton/llm_tensors.py's (re-exported here), plus the numpy dtype and the shape each input is
sent with ([1, 1] for a scalar, [1, n] for stop_words: what the config declares)."""
from __future__ import annotations

import numpy as np

from runtime.triton.llm_tensors import *  # noqa: F401,F403 - the names
from runtime.triton.llm_tensors import CLIENT_DTYPES, INPUTS

DTYPES = CLIENT_DTYPES
_NUMPY = {"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}
NUMPY = {name: _NUMPY[dt] for name, dt in CLIENT_DTYPES.items()}
_DIMS = {name: dims for name, _, dims, _ in INPUTS}


def shape_of(name: str, size: int) -> list[int]:
    """The shape an input is sent with: its config dims with -1 as `size` ([1, 1]; stop_words [1, n])."""
    return [size if d == -1 else d for d in _DIMS[name]]
