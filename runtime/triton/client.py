"""Client of the repository's `generate` model over HTTP or gRPC (tritonclient).

    text, tokens = generate_remote("127.0.0.1:8000", "Once upon a time", max_new_tokens=64)

Close the client when done (this function does): a server being stopped waits for
open connections up to its exit timeout.
"""
from __future__ import annotations

import numpy as np

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


def generate_remote(url: str, prompt: str, max_new_tokens: int | None = None, protocol: str = "http",
                    model: str = "generate", timeout_s: float = 120.0, **sampling) -> tuple[str, list[int]]:
    """(text, new tokens) from the server's generate model; raises ClientError with the server's message."""
    m = _module(protocol)
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
        raise ClientError(f"triton {url}: expected a server there, found none ({e}); "
                          "start one with python -m runtime.triton serve --repo REPO") from None
    finally:
        client.close()


def _one_line(e) -> str:
    msg = e.message() if callable(getattr(e, "message", None)) else str(e)
    status = e.status() if callable(getattr(e, "status", None)) else None
    msg = " ".join(str(msg).split())
    return f"{msg} ({status})" if status else msg
