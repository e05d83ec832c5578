"""The generate model's LLM tensor contract as the OpenAI server sends and reads it: names, Triton and
numpy dtypes, and the shape each input is sent with (runtime/triton/llm_tensors.py owns the names)."""
from __future__ import annotations

import numpy as np

TEXT_INPUT, MAX_TOKENS, STREAM, STOP_WORDS = "text_input", "max_tokens", "stream", "stop_words"
TEMPERATURE, TOP_K, TOP_P, SEED = "temperature", "top_k", "top_p", "seed"
FREQUENCY_PENALTY, PRESENCE_PENALTY = "frequency_penalty", "presence_penalty"
RETURN_NUM_INPUT_TOKENS, RETURN_NUM_OUTPUT_TOKENS = "return_num_input_tokens", "return_num_output_tokens"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
RETURN_LOG_PROBS, TOP_LOGPROBS, RETURN_PROMPT_LOG_PROBS = "return_log_probs", "top_logprobs", "return_prompt_log_probs"
IGNORE_EOS = "ignore_eos"
TEXT_OUTPUT, OUTPUT_IDS, FINISH_REASON = "text_output", "output_ids", "finish_reason"
NUM_INPUT_TOKENS, NUM_OUTPUT_TOKENS = "num_input_tokens", "num_output_tokens"
OUTPUT_LOG_PROBS, TOP_LOG_PROBS_IDS, TOP_LOG_PROBS = "output_log_probs", "top_log_probs_ids", "top_log_probs"
PROMPT_IDS, PROMPT_LOG_PROBS = "prompt_ids", "prompt_log_probs"

DTYPES = {TEXT_INPUT: "BYTES", STOP_WORDS: "BYTES", MAX_TOKENS: "INT32", TOP_K: "INT32", TOP_LOGPROBS: "INT32",
          TEMPERATURE: "FP32", TOP_P: "FP32", FREQUENCY_PENALTY: "FP32", PRESENCE_PENALTY: "FP32", SEED: "UINT64",
          STREAM: "BOOL", RETURN_NUM_INPUT_TOKENS: "BOOL", RETURN_NUM_OUTPUT_TOKENS: "BOOL",
          EXCLUDE_INPUT_IN_OUTPUT: "BOOL", RETURN_LOG_PROBS: "BOOL", RETURN_PROMPT_LOG_PROBS: "BOOL", IGNORE_EOS: "BOOL"}
NUMPY = {"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}
NUMPY = {name: NUMPY[dt] for name, dt in DTYPES.items()}


def shape_of(name: str, size: int) -> list[int]:
    """The shape an input is sent with (Triton's OpenAI frontend's): [1, 1] for a scalar, [1, n] for stop_words."""
    return [1, size]
