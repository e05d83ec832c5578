"""Triton Inference Server deployment: model repository, server launcher, client.

    from runtime.triton import write_triton_repository
    write_triton_repository("build/dyt", "triton_repo")      # what export.build --triton-repo calls

See docs/triton.md and `python -m runtime.triton --help`.
"""
from __future__ import annotations

from pathlib import Path


def write_triton_repository(build: str | Path, repo: str | Path, **options) -> Path:
    """Write a Triton model repository for a finished build directory; returns its path.

    options: the keywords of repository.write_repository (engine, max_batch_size, instances, kind, ...).
    Raises RepositoryError (a UserError: one line for the user). Imported lazily: the
    package itself stays light, so the server's Python backend loads only what it runs.
    """
    from runtime.triton.repository import write_repository
    return write_repository(build, repo, **options)


__all__ = ["write_triton_repository"]
