"""LeRobot 0.6.1 as a numerical reference for the tests: `make test` installs it into .venv/lerobot061
(tests/lerobot_env061/requirements.txt); its scripts run on this interpreter in subprocesses with that folder first
on PYTHONPATH (vlaforge never imports lerobot).

- `policy_folder(kind, root)`: a tiny SmolVLA / SmolVLA with half the expert layers / pi0 / pi0.5 / pi0.5 with an
  empty camera / pi0 and pi0.5 at LeRobot's default config (`*_base`) written by LeRobot's own `save_pretrained`
  (tests/lerobot_env061/make_policy.py), built once per session and shared by the xdist workers; a `*_base` folder's
  tokenizer step names google/paligemma-3b-pt-224, which `hub_cache(out)` holds (the folder's tiny tokenizer);
- `reference(kind, root, inputs, tasks)`: LeRobot's preprocessor outputs, losses, gradients, sampled actions and
  postprocessed actions for one batch (tests/lerobot_env061/reference.py), cached on disk per input content;
- `sample_inputs(kind=...)`: a standard batch for `reference` at the kind's chunk and action pad (`SHAPES`);
- `trained_run(kind, args, root)`: a tiny fine-tune of the kind's folder, trained once per session and shared.
Pass `session_root(tmp_path_factory)` as `root` so the workers share one folder. LeRobot's scripts run in forks of
one warm LeRobot process per test process (`run`, tests/lerobot_env061/warm.py).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from real_lerobot import require_site

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / ".venv" / "lerobot061"
SCRIPTS = Path(__file__).resolve().parent / "lerobot_env061"
KINDS = ("smolvla", "smolvla_half", "pi0", "pi05", "pi05_empty", "pi0_base", "pi05_base")
HUB_TOKENIZER = "google/paligemma-3b-pt-224"  # what a *_base folder's tokenizer step names
CAMERAS = ("observation.images.top", "observation.images.wrist")
IMAGE_SHAPE = (3, 24, 32)
STATE_DIM = ACTION_DIM = 6
CHUNK = 5
MAX_ACTION_DIM = 8
# (chunk_size, max_action_dim) of the kinds not at (CHUNK, MAX_ACTION_DIM): LeRobot's defaults
SHAPES = {"pi0_base": (50, 32), "pi05_base": (50, 32)}
# different token counts (SmolVLA pads to the longest); every word is in the tiny tokenizers' training text
TASKS = ("pick up the red cube", "open the top drawer and then close it", "push the green block left",
         "press the button")


def site() -> Path:
    """The folder LeRobot 0.6.1 is installed in (`make lerobot061-env`, which `make test` runs)."""
    return require_site(SITE, "LeRobot 0.6.1", "make lerobot061-env")


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site()), str(SCRIPTS)]), "PYTHONWARNINGS": "ignore",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def run(script: str, *args: str, timeout: float = 300, **extra_env: str) -> str:
    """tests/lerobot_env061/SCRIPT ARGS under LeRobot 0.6.1 (`extra_env` added to its environment); its stdout
    (asserts it exits 0). Forked from this process's warm LeRobot process (`_Warm`) where the environment it was
    imported with is the call's, else (or with VLAFORGE_TEST_FRESH=1) a fresh interpreter."""
    environment = env(**extra_env)
    warm = None if FRESH else _Warm.get(environment)
    if warm is not None:
        code, stdout, stderr = warm.call(script, args, environment, timeout)
    else:
        done = subprocess.run([sys.executable, str(SCRIPTS / script), *args], env=environment, capture_output=True,
                              text=True, timeout=timeout, cwd=ROOT)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    assert code == 0, f"{script} {' '.join(args)} failed:\n{stdout[-2000:]}\n{stderr[-4000:]}"
    return stdout


FRESH = os.environ.get("VLAFORGE_TEST_FRESH") == "1"  # every script in a new interpreter (conftest.FRESH)
# what modules read once, at import (tests/lerobot_env061/warm.py): a call forks from the warm process only where
# these equal the warm process's own, but for REREAD, which its children read again
IMPORT_TIME = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "MKL_", "TORCH", "PYTHON", "CUDA")
REREAD = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_LEROBOT_HOME")


def _imported(environment: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environment.items() if k.startswith(IMPORT_TIME) and k not in REREAD}


class _Warm:
    """tests/lerobot_env061/warm.py, started by this test process on its first LeRobot call (LeRobot's imports cost
    ~10-15 s a process here; a fork of a process that made them, milliseconds). Ends when this process closes its
    stdin (at exit)."""

    current: _Warm | None = None

    def __init__(self, environment: dict[str, str]):
        import tempfile

        self.owner, self.env = os.getpid(), environment
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, str(SCRIPTS / "warm.py")], env=environment, cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.pending = b""
        ready = self._answer(time.monotonic() + 300, "ready")
        self.ok = ready is not None and ready.get("threads") == 1

    @classmethod
    def get(cls, environment: dict[str, str]) -> _Warm | None:
        """This process's warm process (started now if there is none), or None where `environment` differs from the
        one it was imported with, or it could not start."""
        warm = cls.current
        if warm is not None and (warm.owner != os.getpid() or warm.proc.poll() is not None):
            warm = cls.current = None  # a forked child of this process, or the warm process ended: start another
        if warm is None:
            warm = cls.current = cls({k: v for k, v in environment.items() if k not in REREAD})
            atexit.register(warm.close)
        return warm if warm.ok and _imported(environment) == _imported(warm.env) else None

    def _answer(self, deadline: float, key: str) -> dict | None:
        """The warm process's next answer holding `key`; None if it ended or `deadline` passed."""
        import select

        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        answer = json.loads(line)
        assert key in answer, answer
        return answer

    def call(self, script: str, args: tuple[str, ...], environment: dict[str, str], timeout: float
             ) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) of SCRIPT ARGS in a fork of the warm process; past `timeout` the fork is
        killed and subprocess.TimeoutExpired raised, as subprocess.run does."""
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            job = {"script": script, "args": list(args), "env": environment, "cwd": str(ROOT), "stdout": str(out),
                   "stderr": str(err)}
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
            deadline = time.monotonic() + timeout
            started = self._answer(deadline, "pid")
            ended = self._answer(deadline, "rc") if started else None
            if ended is None:
                if started:
                    os.kill(started["pid"], signal.SIGKILL)
                self.close()
                raise subprocess.TimeoutExpired([script, *args], timeout, stderr=_read(err))
            return ended["rc"], _read(out), _read(err)

    def close(self) -> None:
        if self.owner == os.getpid() and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if _Warm.current is self:
            _Warm.current = None


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def session_root(tmp_path_factory) -> Path:
    """One folder for the whole test session: under xdist the workers' common parent of their base temps."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _locked(path: Path):
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        yield


def policy_folder(kind: str, root: Path) -> Path:
    """ROOT/lerobot061_KIND, written by make_policy.py on first use in the session (any worker; the others wait):
    OUT/policy is LeRobot's policy folder, OUT/info.json its facts (written last: the folder is complete)."""
    assert kind in KINDS, kind
    site()
    out = Path(root) / f"lerobot061_{kind}"
    with _locked(out):
        if not (out / "info.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            run("make_policy.py", kind, str(out))
            assert (out / "info.json").is_file()
        if kind.endswith("_base") and not (out / "hub").is_dir():
            _cache_tokenizer(out)
    return out


def _cache_tokenizer(out: Path) -> None:
    """OUT/hub: a Hugging Face hub cache holding OUT/tokenizer as HUB_TOKENIZER (renamed into place when whole)."""
    from hub_cache import cache_repo

    partial = out / "hub.partial"
    shutil.rmtree(partial, ignore_errors=True)
    cache_repo(partial, HUB_TOKENIZER, out / "tokenizer")
    partial.rename(out / "hub")


def hub_cache(out: Path) -> Path | None:
    """The Hugging Face hub cache (for HF_HUB_CACHE) in which a `*_base` folder's tokenizer step finds
    google/paligemma-3b-pt-224 (the folder's tiny tokenizer); None for the other kinds."""
    cache = Path(out) / "hub"
    return cache if cache.is_dir() else None


def folder_options(out: Path) -> dict[str, str]:
    """The `model.lerobot` settings a folder from `policy_folder` needs beside it: pi0's / pi0.5's declared sizes and
    their local tokenizer (a *_base folder's pipeline names google/paligemma-3b-pt-224: this is it; none for
    SmolVLA)."""
    files = {"sizes": out / "sizes.json", "tokenizer": out / "tokenizer"}
    return {k: str(v) for k, v in files.items() if v.exists()}


QUIET = ("--train.warmup_steps=0", "--train.progress=false", "--train.tensorboard=false")
ONE_STEP = ("--train.batch_size=2", "--train.grad_accum=1", "--train.steps=1")  # a `trained_run` several tests share


def train_args(kind: str, root: Path, data: Path, recipe: str | None = None) -> list[str]:
    """`vlaforge train` of `recipe` (default recipes/KIND.toml) on the kind's folder (`policy_folder`, with its
    `folder_options`) and a fake LeRobot dataset written to `data`, with no warmup, progress bar or TensorBoard: what
    every fine-tune test starts from."""
    from fake_lerobot import write_dataset

    out = policy_folder(kind, root)
    write_dataset(data)
    return ["train", recipe or f"recipes/{kind}.toml", f"--model.lerobot.pretrained={out / 'policy'}",
            *(f"--model.lerobot.{k}={v}" for k, v in folder_options(out).items()), f"--data.path={data}", *QUIET]


def trained_run(kind: str, args: list[str] | tuple[str, ...], root: Path, recipe: str | None = None) -> Path:
    """A fine-tune shared by the session: `vlaforge train` of `train_args(kind, ...)` + ARGS into
    ROOT/lerobot061_runs/<digest of kind, recipe, args>/run (its dataset in ./ds beside it), run on first use by
    any worker (the others wait) and kept. Read it, export it, serve it; never train into it (resume) or change it."""
    from conftest import run_cli

    key = hashlib.sha256(json.dumps([kind, recipe, list(args)]).encode()).hexdigest()[:16]
    out = Path(root) / "lerobot061_runs" / f"{kind}-{key}"
    with _locked(out):
        if not (out / "done").is_file():
            shutil.rmtree(out, ignore_errors=True)
            done = run_cli(*train_args(kind, root, out / "ds", recipe), *args, f"--train.output_dir={out / 'run'}",
                           timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            (out / "done").write_text(json.dumps([kind, recipe, list(args)]) + "\n")
    return out / "run"


def worst_grad(model, theirs: dict[str, torch.Tensor]) -> tuple[int, float]:
    """(tensors compared, the largest relative difference) of a policy model's gradients against LeRobot's (the
    "grad.<LeRobot name>" tensors of `reference`), relative per tensor. A gradient that is zero in exact arithmetic (an
    attention key bias: softmax ignores a per-row constant) is round-off in both (1e-11 .. 4e-9): a tensor whose
    largest gradient is under 1e-3 of the model's largest is measured against that floor."""
    from vlaforge.models.policies.families import family_of

    fam, params = family_of(model.spec.family, "test"), dict(model.named_parameters())
    grads = {k[5:]: v for k, v in theirs.items() if k.startswith("grad.")}
    floor = 1e-3 * max(float(g.abs().max()) for g in grads.values())
    worst = 0.0
    for name, grad in grads.items():
        comp, inner = fam.key(name)
        mine = params[f"{comp}.{inner}"].grad
        assert mine is not None, name
        worst = max(worst, float((mine - grad).abs().max() / max(float(grad.abs().max()), floor)))
    return len(grads), worst


def trained(run: Path, step: int) -> dict[str, torch.Tensor]:
    """A run's weights at `step` (its checkpoints/step_* model.safetensors)."""
    from safetensors.torch import load_file

    return load_file(str(Path(run) / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts over `a`'s names."""
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _digest(kind: str, inputs: dict[str, torch.Tensor], tasks: list[str]) -> str:
    h = hashlib.sha256(json.dumps([kind, list(tasks)]).encode())
    for name in sorted(inputs):
        t = inputs[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:20]


def reference(kind: str, root: Path, inputs: dict[str, torch.Tensor], tasks: list[str]
              ) -> tuple[dict[str, torch.Tensor], dict]:
    """LeRobot 0.6.1's outputs for `inputs` (see reference.py: pre.<key>, losses, loss, grad.<name>, sample,
    actions, post) and its metadata (loss, pre_steps, post_steps decoded); computed once per (kind, content)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    folder = policy_folder(kind, root)
    key = _digest(kind, inputs, tasks)
    out = folder / "references" / f"{key}.safetensors"
    with _locked(out):
        if not out.is_file():
            given = folder / "references" / f"{key}.inputs.safetensors"
            save_file({k: v.detach().cpu().contiguous() for k, v in inputs.items()}, given,
                      metadata={"tasks": json.dumps(list(tasks))})
            partial = out.with_suffix(".partial")
            cache = hub_cache(folder)
            run("reference.py", str(folder / "policy"), str(given), str(partial),
                **({"HF_HUB_CACHE": str(cache)} if cache else {}))
            partial.rename(out)
    with safe_open(out, "pt") as f:
        raw = f.metadata()
    meta = {"loss": float(raw["loss"]), "pre_steps": json.loads(raw["pre_steps"]),
            "post_steps": json.loads(raw["post_steps"])}
    return load_file(out), meta


def sample_inputs(batch: int = 2, seed: int = 0, kind: str | None = None, chunk: int | None = None,
                  max_action_dim: int | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A standard input set: two cameras (B,3,24,32) in [0,1], state (B,6), raw action (B,T,6), noise (B,T,A),
    time (B,) in (0.05, 0.95); tasks of different token lengths. T, A: `chunk` / `max_action_dim`, else the `kind`'s
    (`SHAPES`), else CHUNK (5) / MAX_ACTION_DIM (8)."""
    shape_chunk, shape_pad = SHAPES.get(kind, (CHUNK, MAX_ACTION_DIM))
    chunk, max_action_dim = chunk or shape_chunk, max_action_dim or shape_pad
    g = torch.Generator().manual_seed(seed)
    inputs = {cam: torch.rand(batch, *IMAGE_SHAPE, generator=g) for cam in CAMERAS}
    inputs["observation.state"] = torch.randn(batch, STATE_DIM, generator=g)
    inputs["action"] = torch.randn(batch, chunk, ACTION_DIM, generator=g)
    inputs["noise"] = torch.randn(batch, chunk, max_action_dim, generator=g)
    inputs["time"] = 0.05 + 0.9 * torch.rand(batch, generator=g)
    return inputs, [TASKS[i % len(TASKS)] for i in range(batch)]


def action_stats(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's action statistics as its postprocessor holds them (mean, std, ...)."""
    from safetensors.torch import load_file

    steps = json.loads((folder / "policy" / "policy_postprocessor.json").read_text())["steps"]
    state = next(s["state_file"] for s in steps if s["registry_name"] == "unnormalizer_processor")
    return {k.removeprefix("action."): v for k, v in load_file(folder / "policy" / state).items()
            if k.startswith("action.")}
