"""Triton Inference Server deployment: model repository, server launcher, client.

    from runtime.triton import write_triton_repository
    write_triton_repository("build/dyt", "triton_repo")      # what export.build --triton-repo calls

See docs/triton.md and `python -m runtime.triton --help`.
"""
from __future__ import annotations

from pathlib import Path

from runtime.triton.repository import RepositoryError, check_repository, write_repository


def write_triton_repository(build: str | Path, repo: str | Path, **options) -> Path:
    """Write a Triton model repository for a finished build directory; returns its path.

    options: engine, max_batch_size (8), instances (1), kind ("cpu" | "gpu"),
    max_new_tokens (32), intra_op_threads (0), validate (True); see repository.write_repository.
    Raises RepositoryError (a RuntimeUserError: one line for the user).
    """
    return write_repository(build, repo, **options)


__all__ = ["write_triton_repository", "write_repository", "check_repository", "RepositoryError"]
