"""Client of the repository's `generate` model over HTTP or gRPC (tritonclient).

    text, tokens = generate_remote("127.0.0.1:8000", "Once upon a time", max_new_tokens=64)

Close the client when done (this function does): a server being stopped waits for
open connections up to its exit timeout.
"""
from __future__ import annotations

import numpy as np

from core.errors import first_line
from runtime.session import MissingExtraError, RuntimeUserError

PROTOCOLS = ("http", "grpc")


class ClientError(RuntimeUserError):
    """The server refused the request or could not be reached; the message is the server's."""


def _module(protocol: str):
    if protocol not in PROTOCOLS:
        raise ClientError(f"--protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    try:
        if protocol == "http":
            import tritonclient.http as m
        else:
            import tritonclient.grpc as m
        return m
    except ImportError:
        raise MissingExtraError("runtime.triton client", "triton", f"tritonclient.{protocol}") from None


def build_inputs(m, prompt: str, max_new_tokens: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 ignore_eos: bool | None = None):
    values = [("prompt", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES")]
    for name, v, dt, np_dt in (("max_new_tokens", max_new_tokens, "INT32", np.int32),
                               ("temperature", temperature, "FP32", np.float32),
                               ("top_k", top_k, "INT32", np.int32), ("top_p", top_p, "FP32", np.float32),
                               ("seed", seed, "INT64", np.int64), ("ignore_eos", ignore_eos, "BOOL", np.bool_)):
        if v is not None:
            values.append((name, np.array([v], dtype=np_dt), dt))
    inputs = []
    for name, array, dt in values:
        t = m.InferInput(name, list(array.shape), dt)
        t.set_data_from_numpy(array)
        inputs.append(t)
    return inputs


def check_url(url: str) -> str:
    """HOST:PORT with a port in 1..65535 (what both tritonclient protocols take), or ClientError."""
    host, sep, port = url.rpartition(":")
    ok = bool(sep) and host.strip("[]") != "" and port.isdigit() and 1 <= int(port) <= 65535 \
        and all(c.isalnum() or c in ".-_[]:" for c in host)
    if not ok:
        raise ClientError(f"--url {url!r}: expected HOST:PORT of a Triton server (e.g. 127.0.0.1:8000), "
                          "found something else; pass the server's address")
    return url


def generate_remote(url: str, prompt: str, max_new_tokens: int | None = None, protocol: str = "http",
                    model: str = "generate", timeout_s: float = 120.0, **sampling) -> tuple[str, list[int]]:
    """(text, new tokens) from the server's generate model; raises ClientError with the server's message."""
    m = _module(protocol)
    check_url(url)
    from tritonclient.utils import InferenceServerException
    try:
        if protocol == "http":
            client = m.InferenceServerClient(url=url, connection_timeout=timeout_s, network_timeout=timeout_s)
        else:
            client = m.InferenceServerClient(url=url)
    except Exception as e:  # bad URL syntax
        raise ClientError(f"--url {url!r}: expected HOST:PORT of a Triton server, found an error ({e})") from None
    try:
        inputs = build_inputs(m, prompt, max_new_tokens, **sampling)
        outputs = [m.InferRequestedOutput("text"), m.InferRequestedOutput("tokens")]
        kw = {"client_timeout": timeout_s} if protocol == "grpc" else {}
        result = client.infer(model, inputs, outputs=outputs, **kw)
        text = result.as_numpy("text").reshape(-1)[0]
        tokens = result.as_numpy("tokens").reshape(-1).tolist()
        return (text.decode("utf-8") if isinstance(text, bytes) else str(text)), [int(t) for t in tokens]
    except InferenceServerException as e:
        raise ClientError(f"triton {url} model {model!r}: {_one_line(e)}") from None
    except (ConnectionError, OSError) as e:
        raise ClientError(f"triton {url}: expected a server there, found none ({first_line(e)}); "
                          "start one with python -m runtime.triton serve --repo REPO") from None
    except Exception as e:  # a non-Triton answer, e.g. HTTP sent to the gRPC port: the client libraries raise anything
        raise ClientError(f"triton {url}: expected a Triton {protocol} endpoint, found an answer the {protocol} "
                          f"client cannot read ({type(e).__name__}: {first_line(e)}); check --url and --protocol "
                          "(the HTTP and gRPC ports differ)") from None
    finally:
        client.close()


def _one_line(e) -> str:
    msg = e.message() if callable(getattr(e, "message", None)) else str(e)
    status = e.status() if callable(getattr(e, "status", None)) else None
    msg = " ".join(str(msg).split())
    return f"{msg} ({status})" if status else msg


def decode_with_state(client, m, prompt_ids: list[int], max_new_tokens: int, model: str = "decoder_onnx",
                      sequence_id: int = 1, stop_tokens: tuple[int, ...] = ()) -> list[int]:
    """Greedy tokens from a decoder model whose KV cache lives in the server (implicit state).

    client: an InferenceServerClient of module m (tritonclient.http or tritonclient.grpc).
    The protocol of docs/triton.md: request 1 sends the prompt at position 0 with
    sequence_start; each later request sends the previous token at position = number of
    tokens sent so far; the last request carries sequence_end (a stop token, if one ends
    the generation early, is sent as that last request so the server frees the slot).
    For a full Triton server with the onnxruntime / tensorrt backends (not the CPU one).
    """
    def infer(ids: list[int], position: int, start: bool, end: bool):
        inputs = [m.InferInput("input_ids", [1, len(ids)], "INT64"), m.InferInput("position", [1, 1], "INT64")]
        inputs[0].set_data_from_numpy(np.array([ids], np.int64))                               # [1, T]
        inputs[1].set_data_from_numpy(np.array([[position]], np.int64))                        # [1, 1] -> [1]
        result = client.infer(model, inputs, outputs=[m.InferRequestedOutput("logits")], sequence_id=sequence_id,
                              sequence_start=start, sequence_end=end)
        return result.as_numpy("logits")                                                       # [1, T, V]

    tokens: list[int] = []
    ids, position = list(prompt_ids), 0
    for step in range(max_new_tokens):
        logits = infer(ids, position, start=step == 0, end=step == max_new_tokens - 1)
        position += len(ids)
        ids = [int(logits[0, -1].argmax())]
        tokens.append(ids[0])
        if ids[0] in stop_tokens and step < max_new_tokens - 1:
            infer(ids, position, start=False, end=True)
            break
    return tokens
