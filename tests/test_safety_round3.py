"""The third reliability round's corpus (issue 40): folders a command did not write are never replaced, killed saves
are finished or cleaned, every damaged dataset training refuses is refused by `data info` too, a run that failed
before its first checkpoint does not block its retry, and errors name the cause."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, run_cli
from fake_lerobot import write_dataset
from test_safety import _ckpt, _copy, _train, dataset, hashes, one_line, runs  # noqa: F401 - the fixtures too


@pytest.fixture(scope="module")
def run(runs) -> Path:
    """test_safety's one-step full-format run on the small LeRobot dataset."""
    return runs["full"]


def test_quantize_replaces_only_a_folder_it_wrote_unchanged(tmp_path, run):
    out = tmp_path / "q"
    quantize = ("quantize", str(run), f"--out={out}", "--llm=int8", "--frames=4")
    for _ in range(2):  # its own folder, written again
        done = run_cli(*quantize)
        assert done.returncode == 0, done.stderr[-2000:]
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "quantize.json").write_text("{}")
    (theirs / "results.csv").write_text("a,b\n")
    for folder, message in ((theirs, "was not written by `vlaforge quantize`"),
                            (out, "holds extra.bin, which `vlaforge quantize` did not write")):
        if folder == out:
            (out / "extra.bin").write_bytes(b"mine")
        before = hashes(folder)
        one_line(run_cli("quantize", str(run), f"--out={folder}", "--llm=int8", "--frames=4"), message)
        assert hashes(folder) == before
    # a quantized folder is not float weights: exporting it to safetensors is refused
    one_line(run_cli("export", str(out.parent / "q"), "--out", str(tmp_path / "q.safetensors")),
             "is a `vlaforge quantize` folder")
    assert not (tmp_path / "q.safetensors").exists()


def test_export_to_a_special_path_it_cannot_write_is_one_line(tmp_path, run):
    one_line(run_cli("export", str(run), "--out", "/sys/kernel/vlaforge-test.safetensors"), "cannot write there")


def test_a_very_deep_base_chain_is_one_line(tmp_path):
    from vlaforge.config.loading import MAX_BASE_DEPTH

    (tmp_path / "r0.toml").write_text('[train]\nsteps = 3\n')
    for i in range(1, 200):
        (tmp_path / f"r{i}.toml").write_text(f'base = "r{i - 1}.toml"\n')
    one_line(run_cli("config", "show", str(tmp_path / "r199.toml")), f"base chain deeper than {MAX_BASE_DEPTH}")
    # a chain within the cap still merges
    done = run_cli("config", "show", str(tmp_path / f"r{MAX_BASE_DEPTH - 1}.toml"))
    assert done.returncode == 0 and "steps = 3" in done.stdout, done.stderr[-2000:]


def _edit(root: Path, name: str, fn) -> None:
    path = root / "meta" / name
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _damaged(tmp_path: Path, dataset: Path) -> dict[str, tuple[Path, str]]:
    """Damaged copies of the dataset, each with the words its one-line error must hold."""
    cases = {}

    def case(name, message, change=None):
        root = _copy(dataset, tmp_path / name)
        if change is not None:
            change(root)
        cases[name] = (root, message)

    def truncate(root):
        video = next((root / "videos" / "observation.images.front").rglob("*.mp4"))
        video.write_bytes(video.read_bytes()[: video.stat().st_size // 3])

    case("video", "cannot be decoded", truncate)
    case("stats_nan", "meta/stats.json: action std", lambda r: _edit(
        r, "stats.json", lambda s: s["action"].__setitem__("std", [float("nan")] * 4)))
    case("stats_short", "observation.state mean", lambda r: _edit(
        r, "stats.json", lambda s: s["observation.state"].__setitem__("mean", [0.0])))
    case("state_shape", "declares 'observation.state' with shape [6]", lambda r: _edit(
        r, "info.json", lambda i: i["features"]["observation.state"].__setitem__("shape", [6])))
    nan = tmp_path / "env_nan"
    write_dataset(nan, edit=lambda eps: eps[2]["env_state"].__setitem__((1, 0), np.nan))
    cases["env_nan"] = (nan, "'observation.environment_state' holds NaN")
    return cases


def test_data_info_refuses_every_damaged_dataset_training_refuses(tmp_path, dataset):
    for name, (root, message) in _damaged(tmp_path, dataset).items():
        before = hashes(root)
        one_line(run_cli("data", "info", str(root)), message)
        if name != "video":  # training decodes the videos later, in its loader: test_safety covers that path
            one_line(_train(tmp_path / f"run_{name}", "--data.cache_mb=0", data=root), message)
        assert hashes(root) == before, name


def test_a_run_that_failed_before_its_first_checkpoint_does_not_block_its_retry(tmp_path, dataset):
    missing, out = tmp_path / "not_yet", tmp_path / "run"
    one_line(_train(out, data=missing), "does not exist")
    shutil.copytree(dataset, missing)  # the user fixes the dataset and runs the same command again
    done = _train(out, data=missing)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "checkpoints" / "latest").is_file()
    # a folder with a checkpoint is still never overwritten
    one_line(_train(out, data=missing), "not empty")


def test_causes_are_named_not_symptoms(tmp_path, run, dataset):
    from test_safety import Plant

    # a shape mismatch is a mismatch, not damage
    other = _train(tmp_path / "other", "--model.action_head.hidden=24", f"--train.init_from={run}", data=dataset)
    one_line(other, "does not match the model", "in the file")
    assert "truncated or corrupt" not in other.stderr
    # a refused pickle is named as such, without torch's advice to switch the check off
    copy = _copy(run, tmp_path / "planted")
    torch.save(Plant(tmp_path / "MARKER"), _ckpt(copy) / "trainer_state.pt")
    line = one_line(run_cli("train", "--resume", str(copy), "--train.steps=3"), "is refused",
                    "beyond tensors and plain data")
    assert "weights_only" not in line and not (tmp_path / "MARKER").exists()


class _Saver:
    """A process that saves step 2 of a one-layer model seeded with `seed` into `run` and stops (sleeps) at `stage`
    of the replacement, where the test kills it. Forked from the test process (a save needs none of a fresh
    interpreter's ~2 s of imports; tests/forked.py), or a new interpreter where this process cannot fork."""

    CODE = """
import sys, time, torch
from pathlib import Path
from vlaforge.checkpoints import layout, save

def pause(stage):
    if stage == sys.argv[2]:
        print(stage, flush=True)
        time.sleep(120)

layout._pause = pause
torch.manual_seed(int(sys.argv[3]))
save.save_checkpoint(Path(sys.argv[1]), 2, torch.nn.Linear(3, 3), {"step": 2}, "", keep=3)
print("done", flush=True)
"""

    def __init__(self, run: Path, seed: int, stage: str):
        from forked import can_fork

        if not can_fork():
            self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, str(run), stage, str(seed)], cwd=ROOT,
                                         stdout=subprocess.PIPE, text=True)
            self.lines = self.proc.stdout
            return
        self.proc = None
        read, write = os.pipe()
        sys.stdout.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the child: save, saying where it stopped; never back into pytest
            code = 1
            try:
                os.close(read)
                from vlaforge.checkpoints import layout, save

                def pause(where):
                    if where == stage:
                        os.write(write, f"{where}\n".encode())
                        time.sleep(120)

                layout._pause = pause
                torch.manual_seed(seed)
                save.save_checkpoint(run, 2, torch.nn.Linear(3, 3), {"step": 2}, "", keep=3)
                os.write(write, b"done\n")
                code = 0
            except BaseException:  # noqa: BLE001 - what a process's uncaught exception prints
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(write)
        self.lines = os.fdopen(read)

    def line(self) -> str:
        return self.lines.readline().strip()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
        else:
            os.kill(self.pid, signal.SIGKILL)
        self.wait()

    def wait(self) -> int:
        self.lines.close()
        if self.proc is not None:
            return self.proc.wait()
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])


@pytest.mark.parametrize("stage", ["aside", "removed", "renamed"])
def test_a_kill_while_a_checkpoint_is_replaced_leaves_a_loadable_latest(tmp_path, stage):
    """A save of an existing step killed at each stage of its replacement: readers keep a loadable `latest`, a
    resume (one process) finishes the replacement (the new weights in step_X, nothing hidden left), and so does the
    next save after another such kill."""
    from safetensors.torch import load_file

    from vlaforge.checkpoints import layout as ck

    first = _Saver(tmp_path, 0, "never")
    assert first.line() == "done" and first.wait() == 0
    second = _Saver(tmp_path, 1, stage)
    assert second.line() == stage
    second.kill()
    torch.manual_seed(0)
    old = torch.nn.Linear(3, 3).weight.detach()
    torch.manual_seed(1)
    new = torch.nn.Linear(3, 3).weight.detach()
    seen = ck.resolve_checkpoint(str(tmp_path), ".", what="CHECKPOINT")  # a reader: a complete copy, untouched
    assert (seen / "trainer_state.pt").is_file()
    assert any(torch.equal(load_file(str(seen / "model.safetensors"))["weight"], w) for w in (old, new))
    resumed = ck.resolve_checkpoint(str(tmp_path), ".")  # a resume finishes what the killed save began
    assert resumed.name == "step_00000002"
    assert torch.equal(load_file(str(resumed / "model.safetensors"))["weight"], new)  # the save it was making
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000002"]
    fourth = _Saver(tmp_path, 2, stage)  # killed again; this time the next save, not a resume, puts it right
    assert fourth.line() == stage
    fourth.kill()
    third = _Saver(tmp_path, 3, "never")
    assert third.line() == "done" and third.wait() == 0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000002"]


def test_sigterm_during_generate_leaves_no_partial_folder(tmp_path):
    from forked import _child, can_fork

    out = tmp_path / "ds"
    args = ("data", "generate", f"--out={out}", "--tasks=reach-v3", "--episodes=40", "--image-size=32", "--workers=1",
            "--no-progress")
    with open(tmp_path.parent / f"{tmp_path.name}.err", "w+") as err:
        if can_fork():  # `vlaforge data generate` forked from this process (tests/forked.py): no 8 s of imports
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(args, ROOT, {"PYTHONWARNINGS": "ignore"}, os.open(os.devnull, os.O_WRONLY), err.fileno())
            proc = None
        else:
            proc = subprocess.Popen([sys.executable, "-m", "vlaforge", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                                    stderr=err, text=True)
            pid = proc.pid
        spool = tmp_path / ".ds.episodes"
        deadline = time.monotonic() + 120
        # inside the rollouts: the first attempt is in the spool (past the imports and the simulator's start)
        while not any(p.suffix in (".npz", ".fail") for p in spool.glob("*")) and time.monotonic() < deadline:
            assert os.waitpid(pid, os.WNOHANG) == (0, 0), "generate ended before its first attempt"
            time.sleep(0.05)
        os.kill(pid, signal.SIGTERM)
        status = proc.wait(timeout=60) if proc else os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        err.seek(0)
        text = err.read()
    assert status == 130 and "interrupted" in text, text[-2000:]
    # no dataset and no partial folder; the finished attempts stay in the spool the same command resumes from
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], [".ds.episodes"])
