"""The OpenAI server's Triton side without a server: the inputs it sends are the generate model's config
(names, dtypes, shapes), and the model's messages map to the OpenAI statuses."""
from __future__ import annotations

import pytest

pytest.importorskip("pydantic", reason="runtime.openai needs pydantic (pip install -e '.[dev,triton]')")

from runtime.openai.engine import GenerateRequest, build_inputs, triton_error
from runtime.triton import llm_tensors as T


def test_inputs_match_the_generate_config():
    grpc = pytest.importorskip("tritonclient.grpc")
    req = GenerateRequest("Once upon", max_tokens=5, temperature=0.5, top_p=0.9, top_k=3, seed=7, stop=["a", "bc"],
                          frequency_penalty=0.1, presence_penalty=-0.2, logprobs=True, top_logprobs=2,
                          prompt_logprobs=True, ignore_eos=True, stream=True)
    declared = {name: (dt, dims) for name, dt, dims, _ in T.INPUTS}
    sent = {i.name(): (i.datatype(), i.shape()) for i in build_inputs(grpc, req)}
    assert set(sent) == set(declared) - {T.EXCLUDE_INPUT_IN_OUTPUT, T.INPUT_IDS}
    by_ids = {i.name(): (i.datatype(), i.shape()) for i in build_inputs(grpc, GenerateRequest("", prompt_ids=[4, 5, 6]))}
    assert T.TEXT_INPUT not in by_ids and by_ids[T.INPUT_IDS][1] == [1, 3]       # a token-id prompt: input_ids only
    for name, (dt, shape) in {**sent, **by_ids}.items():
        want_dt, dims = declared[name]
        assert dt == ("BYTES" if want_dt == "STRING" else want_dt), name
        assert len(shape) == len(dims) and all(d in (-1, s) for d, s in zip(dims, shape)), (name, shape, dims)
    assert sent[T.STOP_WORDS][1] == [1, 2]
    assert {i.name() for i in build_inputs(grpc, GenerateRequest("x"))} == {
        T.TEXT_INPUT, T.STREAM, T.RETURN_NUM_INPUT_TOKENS, T.RETURN_NUM_OUTPUT_TOKENS}     # defaults: the model's


@pytest.mark.parametrize("message, status", [
    ("server busy: expected room for one more request, found 8 running and 32 queued; retry later", 503),
    ("internal error: RuntimeError: boom", 500),
    ("input top_k: expected a value >= 0, found -3", 400),
    ("[request id: 4] unexpected inference input 'x' for model 'generate'", 400),
])
def test_model_messages_map_to_statuses(message, status):
    e = triton_error(message)
    assert e.status == status and e.message == message and e.body()["error"]["message"] == message
