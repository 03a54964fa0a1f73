"""A warm LeRobot 0.6.1 process: imports torch, transformers and LeRobot's policies once (~10-15 s a process here),
then runs each script of this folder it is asked for in a forked child of itself - the script's own `__main__`, its
own argv, environment, working folder, stdout and stderr files and exit code - as `python SCRIPT ARGS` would,
without the imports. tests/lerobot061.py:run starts one per test process and sends it every call whose import-time
environment is its own (tests/forked.py does the same for vlaforge's CLI).

usage: PYTHONPATH=.venv/lerobot061:tests/lerobot_env061 python tests/lerobot_env061/warm.py
Reads one JSON request a line on stdin: {"script", "args", "env", "cwd", "stdout", "stderr"} (the two files the
child writes its output to); answers {"pid": ...} once the child runs, then {"rc": ...} when it ended. Ends at EOF.

NOTE: the fork is safe because this process runs no torch op before it (an OpenMP thread team that exists at a fork
hangs the child's first parallel op; tests/conftest.py) and starts no Python thread (it checks): the native threads
the imports start (torch's, pyarrow's jemalloc) are the ones the test process forks its CLI runs with.
"""

from __future__ import annotations

import json
import os
import sys
from typing import NoReturn

TORCH_DEFAULT_SEED = 67280421310721  # torch.initial_seed() of a fresh interpreter
# the environment that modules read once, at import: tests/lerobot061.py sends a request here only where its values
# are this process's, but for these, which each child reads again (`_reread`)
IMPORT_TIME = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "MKL_", "TORCH", "PYTHON", "CUDA")
REREAD = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_LEROBOT_HOME")


def preload() -> None:
    """What the scripts of this folder import, imported once (nothing run: see the NOTE above)."""
    import torch

    torch.set_num_threads(1)
    import lerobot.policies.factory
    import lerobot.policies.pi0.modeling_pi0
    import lerobot.policies.pi05.modeling_pi05
    import lerobot.policies.smolvla.modeling_smolvla
    import lerobot.processor  # noqa: F401
    import safetensors.torch  # noqa: F401
    import tokenizers  # noqa: F401
    import transformers  # noqa: F401

    # how a child ends (tests/forked.py, standard library only), imported here: a child cannot fail to find it. The
    # folder leaves the path again, so that a script resolves its imports as in a fresh interpreter
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.append(tests)
    try:
        import forked  # noqa: F401
    finally:
        sys.path.remove(tests)


def _reread() -> None:
    """REREAD as a fresh import reads it: huggingface_hub's and LeRobot's constants recomputed from this child's
    environment (transformers and huggingface_hub read `constants.HF_HUB_CACHE` at call time; of the modules loaded
    here only LeRobot's processor pipeline copied HF_LEROBOT_HOME)."""
    import importlib

    import huggingface_hub.constants
    import lerobot.processor.pipeline
    import lerobot.utils.constants

    importlib.reload(huggingface_hub.constants)
    importlib.reload(lerobot.utils.constants)
    lerobot.processor.pipeline.HF_LEROBOT_HOME = lerobot.utils.constants.HF_LEROBOT_HOME


def _child(job: dict) -> NoReturn:
    """SCRIPT of `job` in this forked child, ended as `python SCRIPT` ends (tests/forked.py)."""
    from forked import exit_like_interpreter, own_streams

    def script() -> None:
        out = os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        own_streams(out, err)
        import runpy

        import torch

        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        _reread()
        torch.manual_seed(TORCH_DEFAULT_SEED)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), job["script"])
        sys.argv = [path, *job["args"]]
        runpy.run_path(path, run_name="__main__")

    exit_like_interpreter(script)


def main() -> None:
    preload()
    import threading

    threads = threading.active_count()
    answer = sys.stdout
    print(json.dumps({"ready": os.getpid(), "threads": threads}), file=answer, flush=True)
    if threads != 1:  # a thread here could hold a lock at the fork: refuse (the caller then runs scripts fresh)
        return
    for line in sys.stdin:
        job = json.loads(line)
        answer.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(job)
        print(json.dumps({"pid": pid}), file=answer, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=answer, flush=True)


if __name__ == "__main__":
    main()
