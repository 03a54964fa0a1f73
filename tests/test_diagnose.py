"""`vlaforge diagnose`: real runs with injected faults are each diagnosed with the right finding at the right steps
(lr 100x, an fp16 vision tower with shrunken gradients, a stalling loader, a spike in one loss term, one component's
lr 100x another's), a healthy run gives no finding, curves with known shapes are told apart, and the HTML report
renders its plots in a headless browser."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import warnings

import numpy as np
import pytest

from vlaforge.diagnostics.diagnose import diagnose_signals
from vlaforge.diagnostics.loss_curve import divergence, non_finite, oscillation, spikes, stuck
from vlaforge.diagnostics.signals import RunSignals, Series, read_signals
from vlaforge.training import trainer

from conftest import ROOT, run_cli, tiny_config

LR = {"vision": 3e-4, "projector": 1e-3, "llm": 1e-3, "action_head": 1e-3}


def _curve(n=300, seed=0, noise=0.05):
    g = np.random.default_rng(seed)
    steps = np.arange(1, n + 1) * 10
    return steps, (2.0 * np.exp(-steps / 800) + 0.3) * np.exp(noise * g.normal(size=n))


def test_curve_shapes_are_told_apart():
    steps, x = _curve()
    clean = Series(steps, x)
    assert not spikes(clean, "t") and not divergence(clean, "t") and not oscillation(clean, "t") \
        and not stuck(clean, "t")
    hit = x.copy()
    hit[[120, 200]] *= 4
    found = spikes(Series(steps, hit), "t")
    assert sorted(f.evidence["peak_step"] for f in found) == [steps[120], steps[200]]
    rising = x * np.where(steps > 1500, np.exp((steps - 1500) / 500), 1.0)
    (d,) = divergence(Series(steps, rising), "t")
    assert 1300 <= d.steps[0] <= 1700 and d.steps[1] == steps[-1]
    broken = x.copy()
    broken[250:] = np.nan
    (f,) = non_finite(Series(steps, broken), "t")
    assert f.severity == "critical" and f.steps[0] == steps[250]
    flat = Series(steps, 1.0 * np.exp(0.05 * np.random.default_rng(1).normal(size=len(steps))))
    assert stuck(flat, "total")
    bouncing = Series(steps, np.where(np.arange(len(steps)) % 2, 2.0, 0.5) * np.exp(-steps / 1e6))
    assert oscillation(bouncing, "t")


def test_stuck_agrees_with_the_numbers_it_quotes():
    """`stuck` fires on flat curves only (noisy, short, or long); never on a run that fell fast and flattened, nor on
    one that blew up and recovered (which keeps its instability finding); every finding's quoted medians show no
    fall."""
    from vlaforge.diagnostics.loss_curve import instability

    g = np.random.default_rng(3)
    fast = lambda n: np.r_[np.geomspace(2.8, 0.62, n // 5), 0.61 + 0.01 * g.normal(size=n - n // 5)]
    should_not = {
        "fast fall then flat": fast(200),
        "fast fall, a dozen points": fast(12),
        "noisy fall": np.geomspace(3.0, 0.6, 60) * np.exp(0.3 * g.normal(size=60)),
        "blow-up and recovery": np.r_[np.full(3, 8.0), np.geomspace(1e5, 10.0, 40), np.full(20, 9.5)],
    }
    should = {
        "flat, long": 1.0 + 0.05 * g.normal(size=300),
        "flat, a dozen points": 2.0 * np.exp(0.02 * g.normal(size=12)),
        "flat with a fast start": np.r_[np.full(40, 1.0), 1.0 + 0.02 * g.normal(size=160)],
        "rising slowly": np.linspace(1.0, 1.1, 100) * np.exp(0.01 * g.normal(size=100)),
    }
    series = lambda x: Series(np.arange(len(x)) * 10, x)
    for name, x in should_not.items():
        healthy = name != "blow-up and recovery"
        kinds = {f.kind for check in (stuck, divergence, oscillation, instability) + ((spikes,) if healthy else ())
                 for f in check(series(x), "total")}
        assert kinds == (set() if healthy else {"instability"}), (name, kinds)
    for name, x in should.items():
        (f,) = stuck(series(x), "total")
        assert f.evidence["last_quarter_median"] > 0.98 * max(f.evidence["first_quarter_median"],
                                                               f.evidence["first"]), name


def _train_cli(tmp_path, name, *overrides, steps=120):
    run = tmp_path / name
    done = run_cli("train", str(ROOT / "recipes" / "tiny_synthetic.toml"), f"--train.steps={steps}",
                   "--train.log_every=2", f"--train.output_dir={run}", "--train.progress=false",
                   "--train.tensorboard=false", *overrides, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return run


def _diagnose(run, *extra, fresh=False):
    done = run_cli("diagnose", str(run), "--json", *extra, fresh=fresh)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert json.loads((run / "diagnose.json").read_text())["findings"] == report["findings"]
    return report


def _kinds(report):
    return [(f["kind"], f["subject"]) for f in report["findings"]]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return _train_cli(tmp_path_factory.mktemp("diag"), "healthy")


@pytest.mark.slow
def test_a_healthy_run_gives_no_finding_and_a_spike_in_one_term_is_found_at_its_step(healthy, tmp_path):
    report = _diagnose(healthy, fresh=True)
    assert report["findings"] == [] and report["checklist"] == [], report["findings"]
    spiked = tmp_path / "spiked"
    shutil.copytree(healthy, spiked)
    rows = [json.loads(line) for line in (spiked / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r["step"] == 80 and "loss/action" in r:
            r["loss/action"] *= 20
    (spiked / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = _diagnose(spiked, f"--compare={healthy}")
    (f,) = report["findings"]
    assert (f["kind"], f["subject"], f["evidence"]["peak_step"]) == ("spike", "action", 80)
    assert report["checklist"][0] == f["fixes"][0]
    assert report["compare"]["findings"] == [] and report["compare"]["delta"]["loss/total"] == 1.0


@pytest.mark.slow
def test_a_learning_rate_100x_too_high_blows_up_diverges_or_oscillates(tmp_path):
    run = _train_cli(tmp_path, "hot", *[f"--components.{c}.lr={lr * 100}" for c, lr in LR.items()])
    report = _diagnose(run)
    found = [f for f in report["findings"] if f["kind"] in ("divergence", "instability", "oscillation", "non_finite")]
    assert found, report["findings"]
    assert all(0 <= f["steps"][0] <= f["steps"][1] <= 120 for f in found)
    assert "learning rate" in report["checklist"][0]


@pytest.mark.slow
def test_a_component_lr_100x_another_is_flagged(tmp_path):
    run = _train_cli(tmp_path, "ratio", "--components.action_head.lr=0.05", "--components.vision.lr=0.0005",
                     steps=20)
    (f,) = [f for f in _diagnose(run)["findings"] if f["kind"] == "lr_ratio"]
    assert f["subject"] == "action_head" and f["evidence"]["ratio"] == pytest.approx(100)


class _Shrink:
    """The vision tower's gradients 1e-7 times smaller from step 6 on (the phenomenon, exaggerated)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, model):
        from test_numerics import ShrinkGrad

        def hook(module, args, out):
            self.calls += 1
            if self.calls > 6:
                out.last_hidden_state = ShrinkGrad.apply(out.last_hidden_state, 1e-7)
            return out

        model.vision.register_forward_hook(hook)
        return model


def _train_in_process(tmp_path, monkeypatch, name, **sections):
    cfg = tiny_config(tmp_path / name, train={"steps": 16, "log_every": 2}, **sections)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(cfg)
    return tmp_path / name / "run"


def test_fp16_vision_with_shrunken_gradients_is_an_underflow_with_the_bf16_fix(tmp_path, monkeypatch):
    shrink, build = _Shrink(), trainer.build_vla
    monkeypatch.setattr(trainer, "build_vla", lambda *a, **k: shrink(build(*a, **k)))
    run = _train_in_process(tmp_path, monkeypatch, "fp16", components={"vision": {"precision": "fp16"}},
                            loss_scale={"mode": "off"}, numerics={"every": 1})
    report = diagnose_signals(read_signals(run))
    (f,) = [f for f in report["findings"] if f["kind"] == "underflow"]
    assert f["subject"] == "vision" and f["severity"] == "critical" and f["steps"][0] >= 6
    assert "switch components.vision.precision to 'bf16'" in report["checklist"]


def test_a_stalling_loader_is_a_data_stall(tmp_path, monkeypatch):
    build = trainer.build_loader

    def slow_loader(*a, **k):
        for batch in build(*a, **k):
            time.sleep(0.2)
            yield batch

    monkeypatch.setattr(trainer, "build_loader", slow_loader)
    report = diagnose_signals(read_signals(_train_in_process(tmp_path, monkeypatch, "stall")))
    (f,) = [f for f in report["findings"] if f["kind"] == "data_stall"]
    assert f["evidence"]["data_s_median"] >= 0.19


def test_non_finite_values_in_the_file_are_read(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss/total": 1.0 / s if s < 30 else float("nan")}) + "\n" for s in range(1, 40)))
    signals = read_signals(tmp_path)
    assert isinstance(signals, RunSignals) and np.isnan(signals.get("loss/total").values[-1])
    report = diagnose_signals(signals)
    assert report["findings"][0]["kind"] == "non_finite" and report["findings"][0]["steps"][0] == 30


@pytest.mark.slow
def test_the_html_report_renders_its_plots_in_a_headless_browser(healthy, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium here (.ci/run installs Debian's package)")
    from PIL import Image

    html = tmp_path / "report.html"
    assert run_cli("diagnose", str(healthy), f"--html={html}").returncode == 0
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1000,2400", f"file://{html}"], check=True, capture_output=True, timeout=120)
    image = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
    assert image.shape == (2400, 1000)
    # the plots are there: every embedded image decodes to its size, and the page is far from blank
    import base64
    import io
    import re

    pngs = re.findall(r"base64,([A-Za-z0-9+/=]+)", html.read_text())
    assert len(pngs) >= 4
    for data in pngs:
        plot = np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("L"))
        assert plot.shape == (300, 900) and plot.std() > 10
    # and the browser drew them: every row of a plot crosses its axes frame, so the screen rows holding dark pixels
    # cover at least the plots' height
    drawn = ((image < 200).sum(axis=1) >= 2).sum()
    assert drawn >= 0.8 * 300 * len(pngs), (drawn, len(pngs))


def test_memory_steps_match_the_planner_per_component_and_a_gap_is_named(tmp_path, monkeypatch):
    run = _train_in_process(tmp_path, monkeypatch, "mem", diagnostics={"memory_steps": [3]})
    report = diagnose_signals(read_signals(run))
    memory = report["planner"]["memory"]
    assert memory["step"] == 3 and not [f for f in report["findings"] if f["kind"] == "memory_model_gap"]
    for part, row in memory["per_component"].items():  # the accounting and the planner agree on this config
        assert row["measured_gb"] == pytest.approx(row["predicted_gb"], rel=0.02), part
    parts = {p: r["measured_gb"] for p, r in memory["per_component"].items()}
    component, kind = max(parts, key=parts.get).split("/")
    assert memory["biggest"] == f"{component} {kind}"  # the largest part, and the lever for that kind
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # memory the planner does not know about: three times the LLM's activations
        if "memory/llm/activations_gb" in r:
            r["memory/llm/activations_gb"] *= 3
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (f,) = [f for f in diagnose_signals(read_signals(run))["findings"] if f["kind"] == "memory_model_gap"]
    assert f["subject"] == "llm" and f["steps"] == [3, 3]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_gloo_ranks_record_traces_communication_and_their_step_time_spread(tmp_path):
    from launch import train_distributed

    run = tmp_path / "ddp"
    train_distributed(run, "--parallel.backend=ddp", "--parallel.dp_replicate=2", "--train.steps=4",
                      "--diagnostics.profile_steps=[3]")
    assert sorted(p.name for p in (run / "traces").iterdir()) == ["step_00000003_rank_0.json",
                                                                  "step_00000003_rank_1.json"]
    signals = read_signals(run)
    share = signals.get("perf/comm_share")
    assert list(share.steps) == [3] and 0 < share.values[0] < 1  # gloo's all-reduces are in the trace
    assert 0 <= signals.get("perf/comm_overlap").values[0] <= 1
    hi, lo = signals.get("perf/step_s_rank_max"), signals.get("perf/step_s_rank_min")
    assert len(hi) == 4 and np.all(hi.values >= lo.values) and set(signals.get("perf/slowest_rank").values) <= {0, 1}
