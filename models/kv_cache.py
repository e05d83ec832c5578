"""Fixed-capacity KV cache: [B, H, S_max, D] per layer, written in place at a position.

Each sequence b of a batch has its own write position pos[b]; a step of T tokens
writes cache[b, :, pos[b]:pos[b]+T] = update[b]. This is exactly ONNX opset 24
TensorScatter(past, update, write_indices=pos, axis=-2, mode="linear"), which
export/ maps the custom op below onto, so ONNX Runtime and TensorRT can bind the
cache once and update it in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@torch.library.custom_op("tapernorm::cache_write", mutates_args=())
def cache_write(cache: torch.Tensor, update: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Functional form (returns a new cache) used when exporting."""
    out = cache.clone()
    write_cache_(out, update, pos)
    return out


@cache_write.register_fake
def _(cache, update, pos):
    return torch.empty_like(cache)


def write_cache_(cache: torch.Tensor, update: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """In place: cache [B, H, S_max, D], update [B, H, T, D], pos [B] int64."""
    t = update.shape[2]
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None]           # [B, 1]
    cols = pos[:, None] + torch.arange(t, device=cache.device)[None, :]         # [B, T]
    # advanced indices around a slice put the indexed dims first: [B, T, H, D]
    cache[rows, :, cols] = update.permute(0, 2, 1, 3)
    return cache


def write_cache(cache: torch.Tensor, update: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_exporting():
        return torch.ops.tapernorm.cache_write(cache, update, pos)
    return write_cache_(cache, update, pos)


@dataclass(frozen=True)
class KVCacheLayout:
    """Shape of every per-layer key (and value) cache: [batch, n_head, capacity, head_dim]."""
    n_layer: int
    n_head: int
    head_dim: int
    capacity: int

    def shape(self, batch: int) -> tuple[int, int, int, int]:
        return (batch, self.n_head, self.capacity, self.head_dim)

    def allocate(self, batch: int, dtype=torch.float32, device="cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.zeros(self.shape(batch), dtype=dtype, device=device),
                 torch.zeros(self.shape(batch), dtype=dtype, device=device))
                for _ in range(self.n_layer)]
