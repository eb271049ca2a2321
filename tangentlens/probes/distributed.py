"""Data-parallel probing with ``torch.distributed``: N processes, one shard of the tokens each.

Statistics are sums (`Moments`, energy sums, attention accumulators), so the shards
reduce to the single-process answer up to float64 rounding (the heads' null, bounded by
``head_null_sequences``, takes each process's first sequences: ``None`` gives the
single-process null too):

>>> results = run_probe(factory, batches, bases, ("residual", "gradient"), world_size=2)

`launch` spawns the processes (``torch.multiprocessing``, ``spawn``) and joins them
into one group on a free port of 127.0.0.1: gloo by default (it reduces CPU and CUDA
tensors alike, and the payload is only d × d per site), NCCL on request; `shard` splits
a batch list into contiguous whole batches, so each batch is computed exactly as in one
process; `all_reduce_session` reduces a `ProbeSession`.
Functions and arguments given to `launch` travel to the children the way
``multiprocessing`` sends them (pickled in memory): use module-level functions.
Workers die with the process that launched them (Linux ``PR_SET_PDEATHSIG``) and call
`check_parent` before they write: an orphan never goes on writing into a folder whose
lock died with its parent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from ..core.errors import CorruptFileError, UsageError
from ..core.validation import check_int, is_int
from ..models.batches import as_batches
from .driver import run

__all__ = [
    "all_reduce_session",
    "check_parent",
    "die_with_parent",
    "free_port",
    "launch",
    "run_probe",
    "shard",
]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_parent: int | None = None  # in a worker of `launch`: the pid of the process that started it


def shard(batches: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    """Rank ``rank``'s contiguous share of ``batches`` (sizes differ by at most one)."""
    world_size = check_int(world_size, "world_size", minimum=1)
    if not is_int(rank) or not 0 <= rank < world_size:
        raise UsageError(f"rank must be an int in [0, {world_size}); got {rank!r}.")
    items = list(batches)
    base, extra = divmod(len(items), world_size)
    start = rank * base + min(rank, extra)
    return items[start : start + base + (rank < extra)]


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_parent() -> None:
    """In a worker of `launch`: exit at once, writing nothing, if the parent is gone (its
    lock on the output folder went with it). Elsewhere: nothing."""
    if _parent is not None and os.getppid() != _parent:
        os._exit(1)


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this worker when its parent dies, then check that the parent
    did not die before the request was made."""
    global _parent
    _parent = parent
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    check_parent()


def _worker(
    rank: int,
    world_size: int,
    parent: int,
    port: int,
    backend: str,
    fn: Callable[..., Any],
    args: tuple,
    queue: Any,
) -> None:
    die_with_parent(parent)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
    )
    try:
        result = fn(rank, world_size, *args)
        if rank == 0:
            queue.put(("ok", _by_value(result)))
    except BaseException as err:
        if isinstance(err, (UsageError, CorruptFileError, OSError)):  # the user can fix it
            queue.put(("user-error", str(err)))
        else:  # every rank's: the first to fail is the cause, the others its echoes
            queue.put(
                ("error", f"rank {rank}: {type(err).__name__}: {err}\n{traceback.format_exc()}")
            )
        raise
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> Any:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined in one
    process group; return rank 0's return value.

    ``backend``: ``"gloo"`` (default) reduces CPU and CUDA tensors alike, and the reduced
    statistics are only d × d per site; ``"nccl"`` (one GPU per rank, ``cuda:{rank}``) needs
    every reduced tensor on the GPU. A `UsageError`, `CorruptFileError` or `OSError` in any
    rank is raised again as a `UsageError` with its message, and so is a rank killed by a
    signal (naming it and the fix); any other failure as a `RuntimeError` (a bug).
    """
    world_size = check_int(world_size, "world_size", minimum=1)
    if backend not in ("gloo", "nccl"):
        raise UsageError(f"backend must be 'gloo' or 'nccl'; got {backend!r}.")
    _check_open_files(world_size)
    queue = mp.get_context("spawn").SimpleQueue()
    context = mp.spawn(
        _worker,
        args=(world_size, os.getpid(), free_port(), backend, fn, args, queue),
        nprocs=world_size,
        join=False,
    )
    messages: list[tuple[str, Any]] = []

    def drain() -> None:  # read while the ranks run: a large result must not fill the pipe
        while not queue.empty():
            messages.append(queue.get())

    failure: ProcessException | None = None
    done = False
    while not done:
        drain()
        try:
            done = context.join(timeout=0.1)
        except ProcessException as err:
            failure = err
            break
    drain()
    # a user's mistake in any rank wins over the errors it caused in the others
    for kind, payload in messages:
        if kind == "user-error":
            raise UsageError(payload)
    ok = [payload for kind, payload in messages if kind == "ok"]
    if failure is None and ok:
        return _from_value(ok[0])
    if isinstance(failure, ProcessExitedException) and failure.signal_name:
        # killed from outside (the kernel's out-of-memory killer, a person): nothing in
        # the code failed, so the fix is the machine's, not a bug report
        raise UsageError(
            f"worker {failure.error_index} of the {world_size}-process run was killed by "
            f"{failure.signal_name} (out of memory, or stopped from outside); free memory or "
            "lower world_size (--world-size), then rerun: a study resumes from its parts."
        )
    errors = [payload for kind, payload in messages if kind == "error"]
    detail = errors[0] if errors else str(failure or "rank 0 returned nothing")
    if isinstance(failure, ProcessExitedException):
        detail += (
            " (spawned processes re-import the main module: run from a file, with the "
            "launch under `if __name__ == '__main__':`)"
        )
    raise RuntimeError(f"a worker of the {world_size}-process run failed: {detail}")


def _check_open_files(world_size: int) -> None:
    """Refuse a run the open-file limit cannot hold. Each rank holds about twenty files
    once torch is loaded, rank 0 a socket per rank for the rendezvous, and every pair of
    ranks its own: below that, rank 0 cannot accept a peer, which retries for half an hour
    before anything is said."""
    try:
        import resource
    except ImportError:  # pragma: no cover - a system without POSIX resource limits
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 32 + 4 * world_size
    if soft != resource.RLIM_INFINITY and soft < needed:
        raise UsageError(
            f"the open-file limit is {soft}, too few for a {world_size}-process run (it needs "
            f"about {needed}): raise it (ulimit -n {max(1024, needed)}) or lower world_size "
            "(--world-size)."
        )


class _TensorValue:
    """A tensor sent by value: torch's queue reductions would share its memory with a
    process that exits right after sending."""

    def __init__(self, t: torch.Tensor) -> None:
        self.array = t.detach().cpu().numpy()


def _by_value(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _TensorValue(obj)
    if isinstance(obj, dict):
        return {k: _by_value(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_by_value(v) for v in obj)
    return obj


def _from_value(obj: Any) -> Any:
    if isinstance(obj, _TensorValue):
        return torch.from_numpy(obj.array)
    if isinstance(obj, dict):
        return {k: _from_value(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_from_value(v) for v in obj)
    return obj


# ------------------------------------------------------------------ reductions
def all_reduce_session(session: Any) -> Any:
    """Reduce every probe of a closed `ProbeSession` over all ranks, in place, through the
    `Probe` protocol (`Probe.all_reduce_`). A probe that cannot merge exactly (an
    activation sample, ``reservoir=``) raises `UsageError`."""
    for name in sorted(session.probes):
        session.probes[name].all_reduce_(d=session.backend.d_model)
    return session


# ------------------------------------------------------------------ probe runs
def _probe_worker(
    rank: int,
    world_size: int,
    model_factory: Callable[[], Any],
    batches: Sequence[Any],
    bases: Any,
    probes: Sequence[str],
    options: dict[str, Any],
) -> Any:
    progress = bool(options.pop("progress", False)) and rank == 0
    model = model_factory()
    # the passes one process would run (text read into batches, a tensor one batch), so
    # the global pass index, and with it each interval's group, is that process's
    passes = as_batches(model, batches)
    _check_enough(len(passes), world_size)
    mine = shard(passes, rank, world_size)
    first = sum(len(shard(passes, r, world_size)) for r in range(rank))
    given = options.pop("group_of", None)  # of the global pass index, as in one process
    group_of = (lambda i: first + i) if given is None else (lambda i: given(first + i))
    session = run(model, mine, bases, probes, progress=progress, group_of=group_of, **options)
    all_reduce_session(session)
    return session.results() if rank == 0 else None


def _check_enough(n_batches: int, world_size: int) -> None:
    if n_batches < world_size:
        raise UsageError(
            f"{n_batches} batches cannot feed {world_size} processes; pass at least "
            "world_size batches or lower --world-size."
        )


def run_probe(
    model_factory: Callable[[], Any],
    batches: Sequence[Any],
    bases: Any,
    probes: Sequence[str] = ("residual", "attention", "gradient"),
    *,
    world_size: int = 1,
    **options: Any,
) -> Any:
    """`tangentlens.probes.run` over ``batches`` split across ``world_size`` processes;
    returns the merged ``session.results()`` (equal to one process up to rounding).

    ``model_factory()`` builds the model in each process (a module-level function or a
    ``functools.partial``); ``options`` go to `run` (``layers``, ``n_controls``, ``seed``,
    ``progress``, ...). ``world_size=1`` runs in this process.
    """
    if not isinstance(batches, torch.Tensor | Mapping | str):
        batches = list(batches)  # a generator cannot travel to the ranks
        _check_enough(len(batches), world_size)  # fewer items: fewer batches
    if world_size == 1:
        return _probe_worker(0, 1, model_factory, batches, bases, probes, dict(options))
    return launch(_probe_worker, world_size, model_factory, batches, bases, probes, dict(options))
