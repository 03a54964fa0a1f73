"""Shared fixtures: tiny configs, a fixed synthetic batch, and a CLI runner in a subprocess."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

# NOTE: the tests never reach the Hugging Face Hub: Hub ids resolve from caches the tests build (tests/hub_cache.py),
# and the developer's own cache is not read (set before huggingface_hub is imported, which reads them once)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = os.environ.get("VLAFORGE_TEST_HF_HOME") or os.path.join(
    __import__("tempfile").gettempdir(), f"vlaforge-tests-hf-home-{os.getuid()}")
for _name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_LEROBOT_HOME"):
    os.environ.pop(_name, None)

import pytest  # noqa: E402
import torch  # noqa: E402

from vlaforge.config import load_config  # noqa: E402
from vlaforge.config.loading import deep_merge  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny_synthetic.toml"
TEST_BUDGET_S = 60.0  # one test's setup + call + teardown; longer ones are marked over_budget and listed in
# docs/testing.md
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, len(os.sched_getaffinity(0)) // _WORKERS)  # two pytest workers on two cores: one thread each
os.environ["OMP_NUM_THREADS"] = str(THREADS)  # what CLI subprocesses, forked runs and loader workers get
# NOTE: one thread in the test process itself: CLI runs and ranks are forked from it, and an OpenMP thread team
# that exists at a fork hangs the child's first parallel op (libgomp is not fork-safe; measured: a forked training
# stuck in trunc_normal_ after an in-process build with two threads). The child sets its own count.
torch.set_num_threads(1)
# NOTE: CLI runs and ranks are forked from this process (tests/forked.py). A thread that holds a lock at the fork
# deadlocks the child that takes it: tqdm's monitor thread (started by the first progress bar, e.g. transformers'
# weight loading, and taking tqdm's lock every few seconds) and tokenizers' Rust pool; neither starts here.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import tqdm  # noqa: E402 - after the environment variable above, which tokenizers reads at import

tqdm.tqdm.monitor_interval = 0


def tiny_config(tmp_path: Path | None = None, **sections):
    """The tiny recipe with small data, fp32 everywhere, no progress bar, plus section overrides."""
    base = {
        "components": {c: {"precision": "fp32"} for c in ("vision", "projector", "llm", "action_head")},
        "data": {"num_samples": 64},
        "train": {"progress": False, "tensorboard": False, "log_every": 1, "batch_size": 4,
                  "output_dir": str(tmp_path / "run") if tmp_path else "runs/test"},
    }
    return load_config(TINY_RECIPE, deep_merge(base, sections))


def make_batch(cfg, model, size: int = 4, start: int = 0):
    from vlaforge.data.batch import Batch
    from vlaforge.data.loader import build_data

    ds = build_data(cfg, model).dataset
    return Batch.collate([ds[i] for i in range(start, start + size)])


def step_setup(cfg, scaler=None):
    """What the trainer's step takes for `cfg`, built in this process on the CPU from seed 0: (model, loss weighting,
    optimizer, schedule, guards), the guards' loss scaler `scaler` or the config's."""
    from vlaforge import COMPONENTS
    from vlaforge.training.loss_scale import LossScaler
    from vlaforge.training.optim import build_optimizer, build_scheduler
    from vlaforge.training.step import StepGuards
    from vlaforge.training.trainer import build_loss_weighting, build_model

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model, setup = build_model(cfg, cpu)
    weighting = build_loss_weighting(cfg, model, cpu)
    opt = build_optimizer(model, cfg, list(weighting.parameters()))
    guards = StepGuards(scaler or LossScaler.from_config(cfg.loss_scale, setup.used, COMPONENTS))
    return model, weighting, opt, build_scheduler(opt, cfg.train), guards


def policy_grads(cfg) -> dict:
    """Parameter name -> gradient of one loss on a 2-sample batch of the model `cfg` describes, its components'
    policies applied (checkpointing, precision): what a policy must leave unchanged."""
    from vlaforge.training.trainer import build_model

    torch.manual_seed(0)
    model, _ = build_model(cfg, torch.device("cpu"))
    loss, _ = model.compute_loss(make_batch(cfg, model, size=2))
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def fit(model, batch, steps: int, lr: float = 1e-3) -> list[float]:
    """`steps` AdamW steps of `model` on one batch; the losses before each step."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss, _ = model.compute_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


FRESH = os.environ.get("VLAFORGE_TEST_FRESH") == "1"  # every CLI call in a new interpreter, as before 2026-12-03


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300, fresh: bool = False
            ) -> subprocess.CompletedProcess:
    """`vlaforge ARGS` as its own process: forked from this one (tests/forked.py: the same CLI without ~8 s of
    imports), or with `fresh` a new `python -m vlaforge` interpreter (the entry point itself)."""
    from forked import can_fork, run_forked

    if not (fresh or FRESH) and can_fork():
        return run_forked(args, cwd or ROOT, {"PYTHONWARNINGS": "ignore"}, timeout)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "vlaforge", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=timeout)


def train_on_dataset(tmp: Path, name: str, *overrides: str, steps: int = 2, cams: list[str] | None = None) -> Path:
    """`vlaforge train` of the tiny recipe on the fake LeRobot dataset TMP/ds (32 px images of `cams`, default
    fake_lerobot's) into TMP/NAME; asserts it exits 0."""
    import json

    from fake_lerobot import CAMS

    run = tmp / name
    done = run_cli("train", str(TINY_RECIPE), "--data.source=lerobot", f"--data.path={tmp / 'ds'}",
                   f"--model.cameras={json.dumps(cams or CAMS)}", "--model.image_size=32",
                   "--data.max_instruction_tokens=8", f"--train.steps={steps}", "--train.batch_size=4",
                   "--train.progress=false", "--train.tensorboard=false", "--train.log_every=1",
                   f"--train.output_dir={run}", *overrides, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return run


@contextlib.contextmanager
def served(path, *args: str):
    """`vlaforge serve PATH ARGS` in a subprocess on a free port: yields its ws:// URI (grpc:// with --protocol
    lerobot); SIGTERM afterwards must stop it cleanly (exit code 0, "stopped")."""
    server = subprocess.Popen([sys.executable, "-m", "vlaforge", "serve", str(path), "--port=0", *args], cwd=ROOT,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        found = None
        for line in server.stderr:
            found = re.search(r"on ((?:ws|grpc)://[\d.]+:\d+)", line)
            if found:
                break
        assert found, "the server did not start"
        yield found.group(1)
    finally:
        server.send_signal(signal.SIGTERM)
        rc = server.wait(timeout=60)
    assert rc == 0 and "stopped" in server.stderr.read()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# ---- the suite's shape: distributed tests in one xdist group, warm imports for forks, a time budget per test ------

_CURRENT = {"distributed": False}


def check_distributed_marked() -> None:
    """Launchers of ranks call this: a test that starts process groups must be marked `distributed`, which keeps it
    in the one xdist group whose tests run one at a time (two tests of 2-4 ranks each would oversubscribe)."""
    assert _CURRENT["distributed"], "this test starts ranks: mark it @pytest.mark.distributed"


def _module_fixture(item) -> bool:
    """The test uses a module-scoped fixture of its own file (a trained run, an exported package)."""
    return any(defs[-1].scope != "function" and defs[-1].baseid.endswith(".py")
               for defs in item._fixtureinfo.name2fixturedefs.values() if defs)


def _order(item) -> int:
    """NOTE: xdist hands out work units in this order (make test passes --no-loadscope-reorder): the distributed
    group first (the largest unit), then the long single tests, the rest in file order, and last the tests that open
    a GL display in the test process (a worker cannot fork CLI runs after them: tests/forked.py:can_fork)."""
    if item.get_closest_marker("distributed"):
        return 0
    if item.get_closest_marker("over_budget"):
        return 1
    return 3 if item.get_closest_marker("gl") else 2


def pytest_collection_modifyitems(config, items):
    """Groups for `--dist loadgroup`: tests that start ranks share one group (one at a time); tests that share a
    module-scoped fixture share their module's group (the fixture is built once, on one worker)."""
    listed = (ROOT / "docs" / "testing.md").read_text()
    for item in items:
        if item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.xdist_group("distributed"))
        elif _module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
        over = item.get_closest_marker("over_budget")
        if over and f"`{item.originalname}`" not in listed:
            raise pytest.UsageError(f"{item.nodeid} is marked over_budget but not listed in docs/testing.md")
    items.sort(key=_order)


def pytest_runtest_setup(item):
    _CURRENT["distributed"] = item.get_closest_marker("distributed") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test over TEST_BUDGET_S (setup + call + teardown, wall) fails at teardown unless marked over_budget."""
    outcome = yield
    report = outcome.get_result()
    spent = item.stash.setdefault(_SPENT, [0.0])
    spent[0] += call.duration
    if call.when == "teardown" and spent[0] > TEST_BUDGET_S and report.passed \
            and not item.get_closest_marker("over_budget"):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {spent[0]:.0f} s, over the {TEST_BUDGET_S:.0f} s budget of one test: "
                           "share its fixtures or shrink it, or mark it over_budget and list it in docs/testing.md")


_SPENT = pytest.StashKey[list]()


def _warm_imports() -> None:
    """What a CLI run imports, imported once per test process before any fork (tests/forked.py)."""
    import importlib

    for name in ("vlaforge.cli", "vlaforge.cli_deploy", "vlaforge.training.trainer", "vlaforge.models.build",
                 "transformers.models.llama.modeling_llama", "transformers.models.siglip.modeling_siglip"):
        importlib.import_module(name)


_warm_imports()
