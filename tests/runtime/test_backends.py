"""The backend registry: every backend has a test module, unknown names and missing extras fail clearly."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.backends import BACKENDS, Backend, open_session, require
from runtime.session import MissingExtraError

HERE = Path(__file__).parent


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_has_a_test_module(name):
    assert (HERE / f"test_{name}_session.py").is_file(), f"backend {name!r} is registered but has no test module"


def test_missing_extra_names_the_extra_and_the_install_line():
    fake = Backend("x", "runtime.nope", "Nope", "no_such_package_tapernorm", "tensorrt", "cuda", ("cuda",))
    with pytest.raises(MissingExtraError) as e:
        require(fake)
    assert str(e.value) == ("backend 'x' needs the tensorrt extra (no_such_package_tapernorm is not importable); "
                            "pip install 'tapernorm-deploy[tensorrt]'")


def test_unknown_backend():
    from runtime.session import RuntimeUserError
    with pytest.raises(RuntimeUserError, match="expected one of ort, torch, trt"):
        open_session("onnx", "x")
    with pytest.raises(RuntimeUserError, match="--device 'bogus': backend 'ort' expected one of cpu, cuda, tensorrt"):
        open_session("ort", "x", device="bogus")
