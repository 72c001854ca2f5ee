"""Run a function on N local gloo ranks: the benchmarks' multi-rank parts and the multirank tests.

On real clusters use ``torchrun --nproc-per-node N``; this helper exists so a test or a benchmark
can start its own small "cluster" (gloo on CPU, or NCCL with one GPU per rank) and collect what
each rank returns.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
from collections.abc import Callable
from multiprocessing import util as mp_util
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks start from a fork server that imported these once, where one is available (Linux, macOS): a spawned rank
# imports torch afresh, about 1.5 s a rank on a small machine, before it does anything. A rank still gets this
# process's environment, working directory and ``sys.path`` as they are at the launch, as a spawned one does
# (:func:`_worker` sets the first), except what torch reads when it is imported (``TORCH_LOGS``): the server read
# that at the first launch.
PRELOAD = ["torch", "torch.distributed", "dimuon.bench.launch"]


def start_method() -> str:
    """``"forkserver"`` where the platform has it, else ``"spawn"``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world: int,
    port: int,
    out_dir: str,
    threads: int,
    timeout_s: float,
    backend: str,
    fn: Callable,
    args: tuple,
    env: dict[str, str],
) -> None:
    os.environ.clear()  # the launching process's environment, not the one the fork server started with
    os.environ.update(env)
    if timeout_s > 0:  # a hung collective dumps every thread's stack and fails the run instead of hanging
        faulthandler.dump_traceback_later(timeout_s, exit=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    # On an exception the rank exits at once (no barrier): mp.spawn then reports its traceback.
    result = fn(rank, world, *args)
    tmp = Path(out_dir) / f".rank{rank}.tmp"
    tmp.write_bytes(pickle.dumps(result))
    os.replace(tmp, Path(out_dir) / f"rank{rank}.pkl")
    dist.barrier()
    dist.destroy_process_group()
    # torch's gloo backend can abort at interpreter exit once a DeviceMesh group existed ("terminate called
    # without an active exception"), which mp.spawn reports as a crashed rank: a rank that finished leaves at once,
    # after releasing what its multiprocessing objects hold as the interpreter's exit would (a progress bar's lock
    # is a named semaphore: left behind, the launching process's resource tracker warns of a leak at its exit).
    mp_util._run_finalizers(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    threads: int = 1,
    timeout_s: float = 600.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; return each rank's result in rank order.

    ``fn`` must be importable (a module-level function). ``threads`` is the intra-op thread count
    per rank (keep ``world * threads`` at or below the core count). A rank still running after
    ``timeout_s`` seconds prints its stacks and exits, so a hang fails instead of blocking forever; an exception
    in this process while the ranks run (a test's time limit, an interrupt) kills them before it propagates.
    ``backend="nccl"`` gives rank ``r`` the GPU ``cuda:r`` (results come back as they are: move
    tensors to the CPU before returning them).
    """
    method = start_method()
    if method == "forkserver":  # takes effect when the server starts: the first call, in this process
        multiprocessing.set_forkserver_preload(PRELOAD + ([fn.__module__] if fn.__module__ != "__main__" else []))
    with tempfile.TemporaryDirectory() as out_dir:
        ranks = mp.start_processes(
            _worker,
            args=(world, free_port(), out_dir, threads, timeout_s, backend, fn, args, dict(os.environ)),
            nprocs=world,
            join=False,
            start_method=method,
        )
        try:
            while not ranks.join():  # a failed rank raises here, its peers stopped
                pass
        except BaseException:  # also a time limit or an interrupt of this process: no rank outlives it
            for process in ranks.processes:
                if process.is_alive():
                    process.kill()
            for process in ranks.processes:
                process.join()
            raise
        return [pickle.loads((Path(out_dir) / f"rank{r}.pkl").read_bytes()) for r in range(world)]
