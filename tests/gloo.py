"""How a test's ranks and entry-point runs start, and how ranks form one gloo process group.

They start forked from one server process per test process (`rank_context`, `spawn_ranks`,
`run_module_forked`): that server imported torch, diffusers, transformers and peft once, where a
spawned process spends about 8 s of a 2-core machine importing them afresh; it has run no torch op,
so no thread pool is forked. They meet through a file in the test's own directory, not a TCP port: a port picked free
by the parent can be taken by any other process before rank 0 binds it (CI saw `EADDRINUSE`); a
file path cannot."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# what every rank imports anyway, imported once in the fork server
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "diffusers",
    "transformers",
    "peft",
]


def rank_context() -> Any:
    """The multiprocessing context a test's ranks start in: processes forked from the preloaded
    fork server (the preload takes effect when the server starts, on first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def spawn_ranks(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` ranks started from `rank_context()`; returns when all have
    exited, raising if one failed (as `torch.multiprocessing.spawn`)."""
    rank_context()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def join_gloo(rank: int, world: int, directory: str) -> None:
    """Rank `rank` of `world` joins the default gloo group rendezvousing in `directory` (a fresh
    directory per group: the store file must not exist from an earlier group)."""
    import torch.distributed as dist

    path = os.path.join(directory, "gloo_rendezvous")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)


def _module_main(module: str, args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In a forked process: `python -m <module> <args>` as the interpreter runs it (`runpy`, the
    module as `__main__`, `sys.argv`, the environment and working directory replaced), its output
    into the files `out` / `err`, its exit status that of `SystemExit` (1 after an uncaught
    exception, printed as the interpreter prints it), after the `atexit` handlers (Ray's
    disconnect) ran."""
    import atexit
    import runpy
    import traceback

    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the process's own descriptors
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = 1 if isinstance(exc.code, str) else int(exc.code or 0)
    except BaseException:  # noqa: BLE001 - the interpreter's own behaviour: print it, exit 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_module_forked(
    module: str, args: list[str], env: dict[str, str], cwd: str, timeout: float
) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` in `cwd` with exactly `env`, in a process forked from the
    preloaded server (`rank_context`); output captured as text, as `subprocess.run` returns it
    (`subprocess.TimeoutExpired` after `timeout` seconds, the process killed)."""
    ctx = rank_context()
    with tempfile.TemporaryDirectory(prefix="unirl_module_") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = ctx.Process(target=_module_main, args=(module, list(args), dict(env), cwd, out, err))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([sys.executable, "-m", module, *args], timeout)
        with open(out) as f_out, open(err) as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    return subprocess.CompletedProcess([sys.executable, "-m", module, *args], proc.exitcode, stdout, stderr)
