"""The tensor contract of the repository's `generate` model: Triton's LLM conventions.

Names, dtypes and shapes are those Triton's OpenAI frontend sends to a non-vLLM model
(triton-inference-server/server python/openai/openai_frontend/engine/utils/triton.py,
`_create_trtllm_generate_request`, read at commit e1db8a603d863b1317ee859bdeea2be19959462e;
its test model tests/tool_parser_models/tool_stream_py/config.pbtxt declares the same):
every scalar is a [1, 1] tensor, `stop_words` a [1, n] list of strings. Triton's generate
extension (POST /v2/models/generate/generate[_stream], JSON `text_input` plus `parameters`)
turns each JSON key that names an input into a tensor of the shape the config declares
(a scalar into [1, 1], a list of n strings into [1, n]) and every other key into a request
parameter, which the model refuses by name (a list there is refused by Triton itself).

This module is torch- and numpy-free so that an OpenAI server can import the names alone.
Output shapes: the config declares what the model sends.
"""
from __future__ import annotations

from core.contract import INPUT_IDS as _GRAPH_INPUT_IDS

# --- inputs (every one optional; text_input or input_ids, exactly one) -------------------------
TEXT_INPUT = "text_input"                      # BYTES [1, 1] the prompt, UTF-8
INPUT_IDS = _GRAPH_INPUT_IDS                   # INT32 [1, n] the prompt as token ids, instead of text_input (an
                                               # OpenAI client's token-id prompt: lm-eval's tokenized_requests)
MAX_TOKENS = "max_tokens"                      # INT32 new tokens at most (default: the config's max_new_tokens)
STREAM = "stream"                              # BOOL  one response per piece (default false: one response)
STOP_WORDS = "stop_words"                      # BYTES [1, n] stop strings: the text ends before the first one
TEMPERATURE = "temperature"                    # FP32  0 (default) is greedy
TOP_K = "top_k"                                # INT32 0 (default): no top-k cut
TOP_P = "top_p"                                # FP32  1 (default): no nucleus cut
SEED = "seed"                                  # UINT64 the sampling generator's seed (default 0)
FREQUENCY_PENALTY = "frequency_penalty"        # FP32  OpenAI's, in [-2, 2] (default 0)
PRESENCE_PENALTY = "presence_penalty"          # FP32  OpenAI's, in [-2, 2] (default 0)
RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"      # BOOL send num_input_tokens
RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"    # BOOL send num_output_tokens
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"      # BOOL default true; false: text_output starts with the prompt
RETURN_LOG_PROBS = "return_log_probs"          # BOOL send output_log_probs (the chosen tokens')
TOP_LOGPROBS = "top_logprobs"                  # INT32 0-20: send the k most likely tokens per step
RETURN_PROMPT_LOG_PROBS = "return_prompt_log_probs"      # BOOL send prompt_ids and prompt_log_probs
IGNORE_EOS = "ignore_eos"                      # BOOL no stop token: always max_tokens new tokens

# --- outputs -----------------------------------------------------------------------------------
TEXT_OUTPUT = "text_output"                    # BYTES [1, 1] the new text (a stop string left out)
OUTPUT_IDS = "output_ids"                      # INT64 [n] the new token ids (a stop token included)
FINISH_REASON = "finish_reason"                # BYTES [1, 1] "stop" | "length", on the final response only
NUM_INPUT_TOKENS = "num_input_tokens"          # INT32 [1, 1] prompt tokens (final response, when asked)
NUM_OUTPUT_TOKENS = "num_output_tokens"        # INT32 [1, 1] new tokens (final response, when asked)
OUTPUT_LOG_PROBS = "output_log_probs"          # FP32 [n] logprob of each new token
TOP_LOG_PROBS_IDS = "top_log_probs_ids"        # INT64 [n, k] the k most likely tokens per step, best first
TOP_LOG_PROBS = "top_log_probs"                # FP32 [n, k] their logprobs
PROMPT_IDS = "prompt_ids"                      # INT64 [p] the prompt's tokens (first response, when asked)
PROMPT_LOG_PROBS = "prompt_log_probs"          # FP32 [p] their logprobs; NaN for the first (it has none)
# with return_prompt_log_probs and top_logprobs k > 0: the k most likely tokens at each prompt position, best
# first, from the prefill's logits (what a client's is_greedy check compares with); row 0 is -1 / NaN
PROMPT_TOP_LOG_PROBS_IDS = "prompt_top_log_probs_ids"    # INT64 [p, k]
PROMPT_TOP_LOG_PROBS = "prompt_top_log_probs"            # FP32 [p, k] their logprobs

FINISH_STOP, FINISH_LENGTH = "stop", "length"
MAX_TOP_LOGPROBS = 20                          # OpenAI's bound on top_logprobs
SCALAR = (1, 1)

# (name, Triton data type without TYPE_, dims, optional): generate/config.pbtxt's inputs, in order
INPUTS = (
    (TEXT_INPUT, "STRING", SCALAR, True),
    (MAX_TOKENS, "INT32", SCALAR, True),
    (STREAM, "BOOL", SCALAR, True),
    (STOP_WORDS, "STRING", (1, -1), True),
    (TEMPERATURE, "FP32", SCALAR, True),
    (TOP_K, "INT32", SCALAR, True),
    (TOP_P, "FP32", SCALAR, True),
    (SEED, "UINT64", SCALAR, True),
    (FREQUENCY_PENALTY, "FP32", SCALAR, True),
    (PRESENCE_PENALTY, "FP32", SCALAR, True),
    (RETURN_NUM_INPUT_TOKENS, "BOOL", SCALAR, True),
    (RETURN_NUM_OUTPUT_TOKENS, "BOOL", SCALAR, True),
    (EXCLUDE_INPUT_IN_OUTPUT, "BOOL", SCALAR, True),
    (RETURN_LOG_PROBS, "BOOL", SCALAR, True),
    (TOP_LOGPROBS, "INT32", SCALAR, True),
    (RETURN_PROMPT_LOG_PROBS, "BOOL", SCALAR, True),
    (IGNORE_EOS, "BOOL", SCALAR, True),
    (INPUT_IDS, "INT32", (1, -1), True),
)

# (name, Triton data type without TYPE_, dims): generate/config.pbtxt's outputs
OUTPUTS = (
    (TEXT_OUTPUT, "STRING", SCALAR),
    (OUTPUT_IDS, "INT64", (-1,)),
    (FINISH_REASON, "STRING", SCALAR),
    (NUM_INPUT_TOKENS, "INT32", SCALAR),
    (NUM_OUTPUT_TOKENS, "INT32", SCALAR),
    (OUTPUT_LOG_PROBS, "FP32", (-1,)),
    (TOP_LOG_PROBS_IDS, "INT64", (-1, -1)),
    (TOP_LOG_PROBS, "FP32", (-1, -1)),
    (PROMPT_IDS, "INT64", (-1,)),
    (PROMPT_LOG_PROBS, "FP32", (-1,)),
    (PROMPT_TOP_LOG_PROBS_IDS, "INT64", (-1, -1)),
    (PROMPT_TOP_LOG_PROBS, "FP32", (-1, -1)),
)

INPUT_NAMES = tuple(name for name, *_ in INPUTS)
OUTPUT_NAMES = tuple(name for name, *_ in OUTPUTS)
# the tritonclient datatype string of each input (BYTES for Triton's TYPE_STRING)
CLIENT_DTYPES = {name: "BYTES" if dt == "STRING" else dt for name, dt, _, _ in INPUTS}
