"""Run `vlaforge ARGS` in a forked copy of the test process instead of a fresh interpreter.

A fresh `python -m vlaforge` pays ~8 s importing torch, transformers and torchao before it does anything; the
tests call the CLI about eighty times. A fork of the test process, which has imported them already, runs the same
`vlaforge.cli.main` on the same argv in a process of its own (own exit code, own file descriptors 1 and 2, own
signal handlers, own global state) in milliseconds. What a fork cannot show - the `python -m vlaforge` entry
point and import-time failures - is kept by the tests that pass `fresh=True` (at least one per verb).

The child starts as a fresh interpreter would for everything the CLI can observe: torch's default seed, no
inherited multiprocessing children or atexit handlers, default SIGINT/SIGTERM, warnings ignored (the subprocess
runner sets PYTHONWARNINGS=ignore), logging to its own stderr.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable, NoReturn

TORCH_DEFAULT_SEED = 67280421310721  # torch.initial_seed() of a fresh interpreter


GRPC_THREADS = ("event_engine", "grpc_global_tim")  # gRPC core's threads while a channel or server lives


def can_fork() -> bool:
    """False once this process has opened a GL display (a test rendered the simulator in-process): Mesa's driver
    state does not survive a fork, and a forked child that renders hangs (measured: MuJoCo's EGL context). The DRI
    driver library is mapped from the first eglInitialize on; importing mujoco alone maps only libEGL. False too
    while gRPC core runs threads here (a channel or server is open): a child forked then hung in training (measured;
    gRPC logs "Other threads are currently calling into gRPC, skipping fork() handlers")."""
    with open("/proc/self/maps") as f:
        if "_dri.so" in f.read():
            return False
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip().startswith(GRPC_THREADS):
                    return False
        except OSError:  # the thread ended meanwhile
            continue
    return True


def _become_fresh(cwd: Path, env: dict[str, str]) -> None:
    """In the child: what a new `python -m vlaforge` process would start with."""
    import multiprocessing.process
    import multiprocessing.util

    import torch

    os.chdir(cwd)
    os.environ.update(env)
    atexit._clear()  # the test process's handlers are not this process's
    multiprocessing.util._run_after_forkers()
    multiprocessing.process._children.clear()  # the test process's Manager and ranks are not our children
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    inductor = sys.modules.get("torch._inductor.async_compile")
    if inductor is not None:  # NOTE: torch resets its compile process pool at a fork, not the thread pool a compile
        inductor.AsyncCompile.pool.cache_clear()  # waits on: the parent's has no threads here (measured: a child
        # compiling torchao's optimizer step after the test process had compiled hung forever)
    warnings.resetwarnings()
    warnings.simplefilter("ignore")
    torch.manual_seed(TORCH_DEFAULT_SEED)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # a fresh process's count (the parent: 1)
    root = logging.getLogger()
    for h in list(root.handlers):  # pytest's capture handlers: a real process logs to its stderr
        if type(h).__module__.startswith("_pytest"):
            root.removeHandler(h)
    for lg in [root, *(x for x in logging.Logger.manager.loggerDict.values() if isinstance(x, logging.Logger))]:
        for h in lg.handlers:
            if type(h) is logging.StreamHandler:
                h.setStream(sys.stderr)


def own_streams(out_fd: int, err_fd: int) -> None:
    """File descriptors 1 and 2 of this (forked) process on `out_fd` / `err_fd`, and sys.stdout / sys.stderr (and
    their `__` originals) line-buffered text streams over them, as a fresh interpreter's."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, encoding="utf-8", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace",
                                       closefd=False)


def exit_like_interpreter(body: Callable[[], object]) -> NoReturn:
    """Run `body()` in a forked child and end the child as an interpreter ends a script - exit 0; SystemExit's code
    (a code that is not an int printed to stderr, exit 1); an uncaught exception's traceback and exit 1 - then its
    atexit handlers and flushed streams, and `os._exit`: the child never returns into its parent's code. (Also
    tests/lerobot_env061/warm.py's children: this module imports only the standard library.)"""
    code = 1
    try:
        body()
        code = 0
    except SystemExit as exc:  # what the interpreter does with it
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - an uncaught exception: the traceback a real process prints, exit 1
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()  # (the ones the imports registered: what a fresh process runs at its end)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _child(args: tuple[str, ...], cwd: Path, env: dict[str, str], out_fd: int, err_fd: int) -> NoReturn:
    own_streams(out_fd, err_fd)
    import faulthandler

    faulthandler.enable(file=sys.stderr, all_threads=True)  # a hung child's stacks, when the parent aborts it

    def cli() -> None:
        _become_fresh(cwd, env)
        sys.argv = ["vlaforge", *args]
        from vlaforge.cli import main

        main()

    exit_like_interpreter(cli)


def run_forked(args: tuple[str, ...], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`vlaforge *args` in a forked child; the CompletedProcess `subprocess.run(capture_output=True, text=True)`
    gives. Raises subprocess.TimeoutExpired (after killing the child) past `timeout` seconds."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(args, cwd, env, out.fileno(), err.fileno())
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                # where it hangs: every thread's Python stack (faulthandler) into its stderr, then the kill
                os.kill(pid, signal.SIGABRT)
                time.sleep(1.0)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                err.seek(0)
                raise subprocess.TimeoutExpired(["vlaforge", *args], timeout, stderr=err.read()[-20000:])
            time.sleep(0.02)
        code = os.waitstatus_to_exitcode(status)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", errors="replace"))
    return subprocess.CompletedProcess(["vlaforge", *args], code, *texts)


def run_ranks(args: tuple[str, ...], nproc: int, cwd: Path, env: dict[str, str], timeout: float
              ) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node=NPROC -m vlaforge ARGS` with forked ranks: each child gets the
    environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...; rank 0 hosts the
    store), the outputs of all ranks are joined as torchrun's are, and when one rank fails the others are stopped
    and the launch exits 1, as torchrun does."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    files = [(tempfile.TemporaryFile(), tempfile.TemporaryFile()) for _ in range(nproc)]
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank, (out, err) in enumerate(files):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                    "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
                    "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
                    "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "forked", "OMP_NUM_THREADS": "1"}
        pid = os.fork()
        if pid == 0:
            import torch

            torch.set_num_threads(1)
            _child(args, cwd, rank_env, out.fileno(), err.fileno())
        pids[pid] = rank
    codes, deadline = {}, time.monotonic() + timeout
    try:
        while len(codes) < nproc and not any(codes.values()):  # torchrun stops the others when one fails
            for pid, rank in pids.items():
                if rank not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[rank] = os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["torchrun", *args], timeout)
            time.sleep(0.02)
    finally:
        for pid, rank in pids.items():
            if rank not in codes:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    texts, errs = ["", ""], []
    for out, err in files:
        for i, f in enumerate((out, err)):
            f.seek(0)
            text = f.read().decode("utf-8", errors="replace")
            texts[i] += text
            if i:
                errs.append(text)
            f.close()
    failed = {r: c for r, c in codes.items() if c != 0}
    if failed:
        # the failed rank's own last lines at the end, where a test's `stderr[-2000:]` shows them (the others' last
        # lines are only their reaction to its death: "Connection closed by peer")
        first = next(iter(failed))
        texts[1] += (f"\n--- rank {first} (exit {failed[first]}), its last stderr lines ---\n{errs[first][-1200:]}"
                     f"\nforked ranks failed: {failed} (exit codes by rank)\n")
    return subprocess.CompletedProcess(["torchrun", *args], 1 if failed or len(codes) < nproc else 0, *texts)
