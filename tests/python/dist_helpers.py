"""Running a function on two ranks (gloo on 127.0.0.1) from a test, bounded in time.

``spawn(fn, out_dir, args, timeout)`` starts ``world`` processes that each call
``fn(rank, world, out_dir, *args)`` inside an initialised gloo process group
and one torch thread (two ranks on two cores), then waits at most ``timeout``
seconds. A rank that raises (or dies) fails the test with its traceback; one that hangs
is terminated, then killed, and the test fails saying so. Nothing outlives the
call. Results travel through files the ranks write under ``out_dir``, a
folder the caller owns.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# a collective whose peer died fails after this instead of hanging until the test's timeout
COLLECTIVE_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, out_dir, fn, args):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        fn(rank, world, out_dir, *args)
        # both ranks done before either tears gloo down: a rank that destroys the group (rank 0 also hosts the
        # store) while its peer is still talking to it has died with std::terminate on a loaded machine
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # no teardown: the peer may be blocked in a collective; exiting closes the sockets
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _stop(processes):
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def spawn(fn, out_dir: str, args=(), timeout: float = 90.0, world: int = 2) -> None:
    """Runs ``fn(rank, world, out_dir, *args)`` on `world` ranks; raises with
    the failing rank's traceback, or after `timeout` seconds with every rank
    stopped."""
    ctx = mp.start_processes(_entry, args=(world, free_port(), out_dir, fn, args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                errs = _errors(out_dir, world)
                raise TimeoutError(f"ranks {alive} still running after {timeout:.0f}s; stopped them" +
                                   (f"\n{errs}" if errs else ""))
    except mp.ProcessExitedException as e:  # died without a Python exception (a signal, std::terminate)
        raise RuntimeError(f"{e}\n{_errors(out_dir, world)}") from None
    finally:
        _stop(ctx.processes)


def _errors(out_dir: str, world: int) -> str:
    out = []
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.err")
        if os.path.exists(path):
            with open(path) as f:
                out.append(f"--- rank {r} ---\n{f.read()}")
    return "\n".join(out)
