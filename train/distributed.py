"""Data-parallel training under torchrun: the process group, the collectives the loop needs, DDP.

    with data_parallel("cpu") as par:           # world size 1 without torchrun: no process group
        model = par.wrap(model, find_unused=True)
        sums = par.sum([loss_sum, n_tokens])    # the same numbers on every rank

torchrun (torch.distributed.run) starts one process per rank and sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT; with WORLD_SIZE > 1 the process group is set up
here, inside the training entry point (never at import: the CLI tests fork commands from
one interpreter), with backend gloo on the CPU and nccl on CUDA (one GPU per local rank).
Every rank runs the same program on the same global batch order; DistributedDataParallel
all-reduces (averages) the gradients in backward, and the loop all-reduces its evaluation
and calibration sums through `Parallel.sum`, so every rank takes the same decisions.
"""
from __future__ import annotations

import contextlib
import errno
import gc
import os
import re
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from core.errors import EXIT_USER, NO_ROOM, io_errno
from core.lifecycle import no_room
from train.errors import TrainError

# What a lost peer looks like from a surviving rank: gloo raises a plain RuntimeError from its
# TCP transport, nccl a DistBackendError; the launcher then stops the job.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Read error", "Write error",
              "Broken pipe", "NCCL", "gloo/transport", "Socket Timeout", "Timed out")


class RankError(TrainError):
    """An error of this rank alone (its device, a lost peer): said by the rank that meets it, whichever it
    is (the others' errors, which every rank meets alike, rank 0 says for the job)."""
    own_process = True


@dataclass(frozen=True)
class Parallel:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None          # None: one process, no process group
    sharded: bool = False               # --fsdp across ranks: the model is fully_shard-ed (train/sharded.py)

    @property
    def is_main(self) -> bool:
        """Rank 0: the only one that writes the run directory and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def sum(self, values: list[float]) -> list[float]:
        """The sums over ranks of `values` (float64), identical on every rank."""
        if not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def max(self, value: float) -> float:
        if not self.distributed:
            return float(value)
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (a picklable object)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def shard(self, n: int) -> range:
        """This rank's contiguous share of n items (the first n % world ranks take one more)."""
        return self.shard_of(self.rank, n)

    def batches(self, windows: torch.Tensor, batch_size: int):
        """This rank's share of `windows` [n, T + 1] in batches of `batch_size`, on the rank's device.
        Sharded, every forward all-gathers parameters with the other ranks, so every rank runs as
        many as the one with the largest share (rank 0): a rank with fewer ends with empty batches
        [0, T + 1], which add nothing to any sum."""
        mine = self.shard(len(windows))
        for i in range(mine.start, mine.stop, batch_size):
            yield windows[i:min(i + batch_size, mine.stop)].to(self.device)
        if self.sharded:
            most = -(-len(self.shard_of(0, len(windows))) // batch_size)
            for _ in range(most - -(-len(mine) // batch_size)):
                yield windows[:0].to(self.device)

    def shard_of(self, rank: int, n: int) -> range:
        per, extra = divmod(n, self.world_size)
        start = rank * per + min(rank, extra)
        return range(start, start + per + (rank < extra))

    def wrap(self, model: torch.nn.Module, find_unused: bool) -> torch.nn.Module:
        """DistributedDataParallel around `model` (the model itself at world size 1).

        find_unused: a TaperNorm model leaves gamma_tilde out of the graph at g = 1 and gamma
        at g = 0; DDP must then look for the parameters a step did not use (and leaves their
        gradients None, as a single process does). The gate is a Python float set identically
        on every rank; the only buffers (FakeLN's frozen std, train/recipes.py) are set from
        all-reduced sums on every rank, and DDP broadcasts rank 0's before each forward anyway."""
        if not self.distributed:
            return model
        from torch.nn.parallel import DistributedDataParallel
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=find_unused)

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


def launched_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it."""
    def env_int(name: str, default: int) -> int:
        text = os.environ.get(name)
        if text is None:
            return default
        try:
            return int(text)
        except ValueError:
            raise TrainError(f"environment variable {name}={text!r}: expected an integer (torchrun sets it); "
                             f"launch with torchrun, or unset it") from None
    world = env_int("WORLD_SIZE", 1)
    rank, local = env_int("RANK", 0), env_int("LOCAL_RANK", 0)
    if world < 1 or not 0 <= rank < world or local < 0:
        raise TrainError(f"environment RANK={rank}, WORLD_SIZE={world}: expected 0 <= RANK < WORLD_SIZE; launch with "
                         "torchrun, or unset them")
    return rank, world, local


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise TrainError(f"--device {requested}: no CUDA device is visible (torch.cuda.is_available() is False); "
                         "pass --device cpu")
    if local_rank >= torch.cuda.device_count():
        raise RankError(f"local rank {local_rank}: this machine has {torch.cuda.device_count()} CUDA devices; "
                         f"start at most that many processes per node (torchrun --nproc-per-node)")
    return torch.device("cuda", local_rank)


@contextlib.contextmanager
def data_parallel(device: str):
    """The Parallel of this process; with torchrun (WORLD_SIZE > 1) the process group lives for the block."""
    rank, world, local = launched_world()
    dev = resolve_device(device, local)
    if world == 1:
        yield Parallel(device=dev)
        return
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend=backend, **({"device_id": dev} if dev.type == "cuda" else {}))
    try:
        yield Parallel(rank, world, local, dev, backend)
        # every rank leaves together (a normal end only: after an error a peer may be gone): a rank that
        # tore its group down while rank 0 still wrote the last checkpoint was seen to abort in gloo
        # (SIGABRT, "terminate called without an active exception") under a loaded machine
        dist.barrier()
    finally:
        # the training model is unreachable by now but alive in reference cycles (measured: FSDP's 3 modules and
        # ~1500 objects a rank), and through its mesh it holds the group and gloo's pending work; freed by a later
        # collection, possibly during interpreter shutdown, where gloo's threads can abort the rank (SIGABRT,
        # "terminate called without an active exception": seen once more in a loaded fresh-clone test run;
        # pytorch/pytorch#179291 describes that path). Free it now, while the group and the interpreter live.
        gc.collect()
        dist.destroy_process_group()


def peer_lost_reason(e: BaseException) -> str:
    """gloo's message without its source location and advice: `Read error [127.0.0.1]:35254: Connection reset by peer`."""
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]
    return text[:160]


def ignore_launcher_stop() -> None:
    """After a rank is lost, torchrun stops the survivors with SIGTERM; this rank has its one-line
    message ready and is exiting, so that signal must not turn into a second message."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def writing_together(par: Parallel, where: str | os.PathLike):
    """A write that every rank leaves the same way: a full disk or quota, or a read-only file system, met
    by any rank inside (rank 0 alone writes a replicated checkpoint) is agreed on after it (one all-reduce,
    which every rank reaches), then rank 0 raises it (naming `where` if it was another rank's) and the
    others exit 1 quietly. So the job says it once, and no rank waits for a peer that stopped in a write."""
    failure, code = None, 0
    try:
        yield
    except BaseException as e:
        if not par.distributed:
            raise
        code = _room_errno(e, where)
        if code not in NO_ROOM:
            raise
        failure = e if io_errno(e) else None        # one that names no errno is said as no_room(where) below
    if not par.distributed:
        return
    code = int(par.max(float(code or 0)))
    if code == 0:
        return
    # torchrun stops the others (SIGTERM) as the first rank exits: no rank leaves before every rank ignores it,
    # so that rank 0's line is not replaced by an interrupt's
    ignore_launcher_stop()
    par.barrier()
    if not par.is_main:
        raise SystemExit(EXIT_USER)
    raise failure if failure is not None else no_room(where, code)


FULL_BYTES = 64 << 10     # a file system with less free space than this is full for a checkpoint's write


def _room_errno(e: BaseException, where) -> int | None:
    """io_errno(e), or ENOSPC for torch.save's "unexpected pos" with no OSError behind it when `where`'s file
    system has no room left: a short write on a full disk sometimes reaches torch's zip writer unraised (seen
    once in the suite: two ranks filling a 64 KiB file system, rank 0's error with no __context__)."""
    code = io_errno(e)
    if code is None and "unexpected pos" in str(e):
        folder = next((p for p in Path(where).parents if p.is_dir()), None)
        with contextlib.suppress(OSError):
            if folder is not None and shutil.disk_usage(folder).free < FULL_BYTES:
                return errno.ENOSPC
    return code


def peer_lost(e: BaseException) -> bool:
    """Whether `e` (raised inside a collective) means another rank is gone."""
    if isinstance(e, dist.DistError):
        return True
    return isinstance(e, RuntimeError) and dist.is_initialized() and any(s in str(e) for s in _PEER_LOST)


SINGLE = Parallel()   # one process, no process group
