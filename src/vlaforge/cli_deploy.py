"""The deployment verbs of `vlaforge` (eval, serve, export, quantize): each calls one function elsewhere.
`vlaforge.cli` registers them on the one command next to the training and inspection verbs."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from vlaforge.config.schema import MAX_ENV_SEED
from vlaforge.errors import VlaforgeError

app = typer.Typer()
_DEFAULT = "; default: the same key of the eval section in the checkpoint's config"
_BACKEND = "auto (a package's runtime for an exported package, else torch), torch, onnx, executorch"


_CHECKPOINT = ("a run folder (its latest checkpoint), a checkpoints/step_* folder, a `vlaforge quantize` folder, an "
               "exported package, or a LeRobot policy folder or its Hub id (lerobot/smolvla_base[@revision], from "
               "the Hugging Face cache or downloaded there)")


_LEROBOT_HELP = {"tokenizer": "a LeRobot policy folder: a tokenizer folder or Hub id instead of the one its pipeline "
                             "names (pi0's google/paligemma-3b-pt-224, which resolves through the cache by itself)",
                 "vlm": "a LeRobot SmolVLA folder: a VLM folder or Hub id instead of the one its config.json names",
                 "sizes": "a LeRobot pi0 / pi0.5 folder: a JSON file of other sizes than LeRobot's variants "
                          "(docs/lerobot_policies.md)"}


@app.command("eval")
def eval_(checkpoint: Path = typer.Argument(..., help=_CHECKPOINT),
          benchmark: Optional[str] = typer.Option(None, help="a LIBERO suite (libero_spatial, libero_object, "
                                                             "libero_goal, libero_10) under LIBERO's protocol: all "
                                                             "its tasks, 50 episodes each from the fixed initial "
                                                             "states, the suite's step limit (docs/libero.md)"),
          tasks: Optional[str] = typer.Option(None, help="comma-separated Meta-World tasks, each once; default: "
                                                         "eval.tasks of the checkpoint's config, else the dataset's "
                                                         "tasks. With "
                                                         "--benchmark: the first N tasks, or task indices / names "
                                                         "(a reduced protocol)"),
          episodes: Optional[int] = typer.Option(None, min=1, help="held-out episodes per task" + _DEFAULT +
                                                 "; with --benchmark: 50 (fewer is a reduced protocol)"),
          execute: Optional[int] = typer.Option(None, min=1, help="actions executed per predicted chunk" + _DEFAULT),
          max_steps: Optional[int] = typer.Option(None, min=1, help="steps before failure" + _DEFAULT +
                                                  "; with --benchmark: the suite's. At most the "
                                                  "simulator's episode limit (Meta-World: 500; a LIBERO suite's)"),
          workers: Optional[int] = typer.Option(None, min=1, help="rollout processes" + _DEFAULT),
          seed: Optional[int] = typer.Option(None, min=0, max=MAX_ENV_SEED, help="base seed of held-out positions"
                                                                                  + _DEFAULT),
          out: Optional[Path] = typer.Option(None, help="report folder (default CHECKPOINT/eval; for a Hub id "
                                                        "eval/ORG--NAME)"),
          video: Optional[bool] = typer.Option(None, help="write one MP4 per task" + _DEFAULT),
          cache: str = typer.Option("exact", help="frame-feature cache: none, exact (each frame encoded once; same "
                                                  "actions), frame (reuse a similar frame's features), token "
                                                  "(recompute only changed patches)"),
          cache_threshold: Optional[float] = typer.Option(None, help="similarity at or above which the cache "
                                                                      "reuses: frame mode's frame cosine (default "
                                                                      "0.99), token mode's patch cosine (0.996)"),
          compile: str = typer.Option("off", help="torch.compile the two regions: off, default, reduce-overhead, "
                                                  "max-autotune"),
          dtype: str = typer.Option("auto", help="inference dtype: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16, fp16"),
          device: str = typer.Option("cpu", help="cpu, cuda, cuda:N or auto"),
          backend: str = typer.Option("auto", help=_BACKEND),
          asynchronous: bool = typer.Option(False, "--async/--sync", help="compute the next chunk in a background "
                                                                          "thread while the current one executes"),
          merge: str = typer.Option("replace", help="chunk merge: replace, ensemble (ACT temporal ensembling), rtc "
                                                    "(real-time chunking; flow-matching heads). vlaforge's rtc "
                                                    "inpaints the committed actions on the flow's own path at each "
                                                    "Euler step, where LeRobot's RTCConfig guides the velocity "
                                                    "towards them (max_guidance_weight); it is not built for LeRobot "
                                                    "policies yet"),
          latency_ms: float = typer.Option(0.0, min=0.0, help="simulated inference delay added to each prediction "
                                                              "(robot clock)"),
          distractors: str = typer.Option("auto", help="auto (as the training dataset was rendered), shown, hidden: "
                                                       "the tasks' distractor bodies (reach's puck)"),
          server: Optional[str] = typer.Option(None, help="ws://HOST:PORT: predict through a running vlaforge serve "
                                                          "(of this checkpoint) instead of in this process"),
          api_key: Optional[str] = typer.Option(None, envvar="VLAFORGE_API_KEY", help="the server's API key"),
          progress: bool = typer.Option(True, help="show a progress bar"),
          lerobot_tokenizer: Optional[str] = typer.Option(None, help=_LEROBOT_HELP["tokenizer"]),
          lerobot_vlm: Optional[str] = typer.Option(None, help=_LEROBOT_HELP["vlm"]),
          lerobot_sizes: Optional[Path] = typer.Option(None, help=_LEROBOT_HELP["sizes"])):
    """Closed-loop success rate per task in Meta-World or on a LIBERO suite (--benchmark), with Wilson 95% intervals;
    writes report.json with the inference options and figures (latency p50/p99 per prediction, cache hit rates, robot
    idle fraction)."""
    from vlaforge import hub
    from vlaforge.checkpoints.layout import local_checkpoint, saved_config
    from vlaforge.evaluation.closed_loop import InferenceOptions, evaluate, render_table
    from vlaforge.inference.runtime import resolve_policy

    if out is None and hub.looks_like_id(str(checkpoint)):  # never into the Hugging Face cache
        out = Path("eval") / str(checkpoint).replace("/", "--").replace("@", "--")
    checkpoint = local_checkpoint(checkpoint)
    settings = lerobot_settings(checkpoint, tokenizer=lerobot_tokenizer, vlm=lerobot_vlm, sizes=lerobot_sizes)
    ckpt = resolve_policy(checkpoint)
    cfg = saved_config(ckpt, lerobot=settings)
    e = cfg.eval
    scenes = {"auto": None, "shown": False, "hidden": True}
    if distractors not in scenes:
        raise VlaforgeError(f"--distractors {distractors!r} is not one of auto, shown, hidden")
    pick = lambda v, d: d if v is None else v
    names, episodes, max_steps, protocol = _eval_tasks(cfg, benchmark, tasks, episodes, max_steps, distractors)
    options = InferenceOptions(cache=cache, compile=compile, dtype=dtype, device=device,
                               execute=pick(execute, e.execute), asynchronous=asynchronous, merge=merge,
                               latency_ms=latency_ms, cache_options=_cache_threshold(cache, cache_threshold),
                               server=server, api_key=api_key, backend=backend, lerobot=settings)
    report = evaluate(ckpt, names, pick(episodes, e.episodes), options=options,
                      max_steps=pick(max_steps, e.max_steps), workers=pick(workers, e.workers),
                      seed=pick(seed, e.seed), out=out, video=pick(video, e.video), progress=progress,
                      hide_distractors=scenes[distractors], protocol=protocol)
    typer.echo(render_table(report))
    typer.echo(f"report: {report['report']}")


def _eval_tasks(cfg, benchmark: str | None, tasks: str | None, episodes: int | None, max_steps: int | None,
                distractors: str):
    """What `vlaforge eval` rolls out: (task names, episodes, step limit, LIBERO protocol or None). A LIBERO suite's
    protocol for --benchmark or for a run trained on `data generate --suite`; else Meta-World's tasks under the
    checkpoint's step limit."""
    from vlaforge.data import libero
    from vlaforge.data.generate import check_step_limit
    from vlaforge.data.metaworld import parse_tasks
    from vlaforge.evaluation.closed_loop import eval_tasks, libero_protocol

    if benchmark is None:
        names = parse_tasks(tasks) if tasks else eval_tasks(cfg)
        if not all(libero.is_libero_task(t) for t in names):
            check_step_limit(names[0], cfg.eval.max_steps if max_steps is None else max_steps,
                             "--max-steps" if max_steps is not None else "eval.max_steps of the checkpoint's config")
            return names, episodes, max_steps, None
        benchmark = names[0].partition("/")[0]  # a run trained on `data generate --suite`: its suite's protocol
    if distractors != "auto":
        raise VlaforgeError(f"--distractors {distractors} applies to Meta-World's tasks, not to LIBERO's "
                            f"{benchmark}; drop it")
    return libero_protocol(benchmark, tasks, episodes, max_steps)


def lerobot_settings(checkpoint: Path, **given: str | None) -> dict | None:
    """The `--lerobot-*` options as `model.lerobot` settings for a LeRobot policy folder (None: none given).

    Raises:
        VlaforgeError: one given for something that is not a LeRobot policy folder.
    """
    from vlaforge.models.policies.reader import is_lerobot_folder

    chosen = {k: str(v) for k, v in given.items() if v is not None}
    if chosen and not is_lerobot_folder(checkpoint):
        raise VlaforgeError(f"--lerobot-{next(iter(chosen))} applies to a LeRobot policy folder, and {checkpoint} is "
                            "not one (a run fine-tuned from one keeps these settings itself); drop it")
    return chosen or None


@app.command()
def serve(checkpoint: Path = typer.Argument(..., help=_CHECKPOINT),
          host: str = typer.Option("127.0.0.1", help="interface to bind; anything but loopback should have an API key"),
          port: int = typer.Option(8000, min=0, max=65535, help="websocket port (openpi protocol; also GET /healthz, "
                                                                "/metrics), or the gRPC port with --protocol lerobot"),
          protocol: str = typer.Option("openpi", help="openpi (websocket, msgpack) or lerobot (LeRobot's "
                                                      "AsyncInference gRPC service, for its robot_client; "
                                                      "docs/lerobot.md)"),
          fps: float = typer.Option(30.0, min=0.1, max=1000.0, help="lerobot: the robot's control rate, which "
                                                                    "timestamps the actions of a chunk"),
          keep_adapters: bool = typer.Option(False, help="a LoRA run: keep its adapters unmerged over its base, with "
                                                         "the --adapter runs beside it; a client names its adapter "
                                                         "(docs/lora.md)"),
          adapter: list[str] = typer.Option([], help="NAME=RUN: another LoRA run over the same base, served as NAME "
                                                     "(repeatable, each NAME once and not the served run's own "
                                                     "name; needs --keep-adapters)"),
          http_port: Optional[int] = typer.Option(None, min=0, max=65535, help="HTTP port for POST /act (default: "
                                                                               "port + 1; 0: none)"),
          max_batch: int = typer.Option(8, min=1, max=256, help="predictions per batched forward"),
          max_wait_ms: float = typer.Option(5.0, min=0.0, max=1000.0, help="longest wait to fill a batch"),
          api_key: Optional[str] = typer.Option(None, envvar="VLAFORGE_API_KEY",
                                                help="required key (header 'Authorization: Api-Key KEY')"),
          max_message_mb: float = typer.Option(16.0, min=0.01, max=1024.0, help="largest request"),
          max_connections: int = typer.Option(64, min=1, help="open connections at most"),
          idle_timeout_s: float = typer.Option(300.0, min=1.0, help="close a connection silent this long"),
          cache: str = typer.Option("exact", help="frame-feature cache: none, exact, frame, token"),
          compile: str = typer.Option("off", help="torch.compile: off, default, reduce-overhead, max-autotune"),
          dtype: str = typer.Option("auto", help="auto (bf16 on CUDA, fp32 on CPU), fp32, bf16, fp16"),
          device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N"),
          backend: str = typer.Option("auto", help=_BACKEND),
          lerobot_tokenizer: Optional[str] = typer.Option(None, help=_LEROBOT_HELP["tokenizer"]),
          lerobot_vlm: Optional[str] = typer.Option(None, help=_LEROBOT_HELP["vlm"]),
          lerobot_sizes: Optional[Path] = typer.Option(None, help=_LEROBOT_HELP["sizes"])):
    """Serve a policy to robot clients: openpi's websocket protocol (msgpack) or LeRobot's gRPC robot client
    (--protocol lerobot), dynamic batching across connections, HTTP POST /act, Prometheus GET /metrics. Stops
    cleanly on SIGTERM / Ctrl-C."""
    from vlaforge.checkpoints.layout import local_checkpoint
    from vlaforge.inference.runtime import PolicyRuntime
    from vlaforge.serving.server import PolicyServer, ServeOptions

    checkpoint = local_checkpoint(checkpoint)  # a Hub id: its cached snapshot
    if protocol not in ("openpi", "lerobot"):
        raise VlaforgeError(f"--protocol {protocol!r} is not one of openpi, lerobot")
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        typer.echo(f"warning: serving on {host} without an API key: anyone who reaches the port can drive the "
                   "policy; set --api-key or VLAFORGE_API_KEY", err=True)
    if adapter and not keep_adapters:
        raise VlaforgeError("--adapter NAME=RUN serves LoRA runs side by side; add --keep-adapters")
    named = None
    if keep_adapters:
        from vlaforge.checkpoints.layout import resolve_checkpoint
        from vlaforge.inference.adapters import parse_adapters, run_name

        named = parse_adapters(adapter, run_name(resolve_checkpoint(str(checkpoint), ".", what="CHECKPOINT")))
    settings = lerobot_settings(checkpoint, tokenizer=lerobot_tokenizer, vlm=lerobot_vlm, sizes=lerobot_sizes)
    runtime = PolicyRuntime.load(checkpoint, device=device, dtype=dtype, compile=compile, cache=cache,
                                 backend=backend, adapters=named, lerobot=settings)
    options = ServeOptions(host=host, port=port, http_port=http_port, max_batch=max_batch, max_wait_ms=max_wait_ms,
                           api_key=api_key, max_message_bytes=int(max_message_mb * 2**20),
                           max_connections=max_connections, idle_timeout_s=idle_timeout_s, protocol=protocol,
                           fps=fps)
    try:
        PolicyServer(runtime, options, metadata=_serve_metadata(runtime),
                     log=lambda m: typer.echo(m, err=True)).run()
    except OSError as exc:
        raise VlaforgeError(f"cannot serve on {host}:{port} ({exc.strerror or exc}); choose another --port") from None


def _serve_metadata(runtime) -> dict:
    """What a client is told on connect beyond the runtime's description: an instruction example, versions."""
    from vlaforge import __version__
    from vlaforge.checkpoints.layout import saved_config
    from vlaforge.data.metaworld import TASKS
    from vlaforge.evaluation.closed_loop import eval_tasks

    cfg = saved_config(Path(runtime.source))
    try:
        tasks = eval_tasks(cfg)  # the config's eval.tasks, else its dataset's (when that is on this machine)
    except VlaforgeError:
        tasks = []
    example = TASKS.get(tasks[0]).instructions[0] if tasks else None
    return {"model_id": str(runtime.source), "instruction_example": example, "vlaforge_version": __version__}


def _cache_threshold(mode: str, value: float | None) -> dict:
    if value is None:
        return {}
    if mode not in ("frame", "token"):
        raise VlaforgeError(f"--cache-threshold applies to --cache frame or token, not {mode}")
    return {f"{mode}_threshold": value}


@app.command()
def export(checkpoint: Path = typer.Argument(..., help="a run folder (its latest checkpoint) or a checkpoints/step_* "
                                                       "folder; for --format lerobot also a LeRobot policy folder"),
           format: str = typer.Option("safetensors", "--format", help="safetensors (one consolidated weights file), "
                                                                      "onnx (a policy package for ONNX Runtime, "
                                                                      "TensorRT, QNN), executorch (.pte programs, "
                                                                      "XNNPACK), lerobot (a LeRobot policy folder "
                                                                      "from a LeRobot folder or a run fine-tuned "
                                                                      "from one)"),
           out: Optional[Path] = typer.Option(None, help="safetensors: the file to write (default "
                                                         "CHECKPOINT/model.safetensors); onnx, executorch, lerobot: "
                                                         "the folder (an existing one is replaced only if the same "
                                                         "export wrote it, unchanged)"),
           dtype: str = typer.Option("fp32", help="onnx: fp32 or fp16 graphs"),
           quantized: bool = typer.Option(False, "--quantized", help="onnx: int8 QDQ graphs (ONNX Runtime static "
                                                                     "quantization, calibrated on dataset frames)"),
           calibrate: Optional[int] = typer.Option(None, min=1, help="onnx --quantized: calibration frames "
                                                                     "[default: 256]"),
           frames: Optional[int] = typer.Option(None, min=1, help="onnx: dataset frames the package is checked on "
                                                                  "against the checkpoint [default: 32]"),
           data: Optional[str] = typer.Option(None, help="onnx: the dataset of those frames (default: the run's "
                                                         "data.path; none: random observations)"),
           lerobot_tokenizer: Optional[str] = typer.Option(None, help=_LEROBOT_HELP["tokenizer"]),
           lerobot_vlm: Optional[str] = typer.Option(None, help=_LEROBOT_HELP["vlm"]),
           lerobot_sizes: Optional[Path] = typer.Option(None, help=_LEROBOT_HELP["sizes"])):
    """Consolidate a checkpoint's weights into one safetensors file (a sharded checkpoint's shards are read in this
    one process), or write a policy package: manifest.json, tokenizer.json, vision.onnx and policy.onnx
    (encoder.onnx + denoise.onnx for a flow-matching head; .pte programs for executorch), checked against the
    checkpoint on dataset frames (export.json: action error, latency of both). `vlaforge eval` and `vlaforge serve`
    run a package like a checkpoint; or write a LeRobot policy folder (--format lerobot: config.json, model.safetensors,
    LeRobot's processor pipelines; docs/lerobot_policies.md) that LeRobot's `from_pretrained` loads."""
    from vlaforge.checkpoints.export import export_weights
    from vlaforge.checkpoints.layout import local_checkpoint, refuse_lerobot_policy, resolve_checkpoint
    from vlaforge.models.policies.reader import is_lerobot_folder

    checkpoint = local_checkpoint(checkpoint)

    formats = ("safetensors", "onnx", "executorch", "lerobot")
    if format not in formats:
        raise VlaforgeError(f"--format {format!r} is not one of {', '.join(formats)}")
    onnx_only = [name for name, given in (("--dtype", dtype != "fp32"), ("--quantized", quantized),
                                           ("--data", data is not None), ("--calibrate", calibrate is not None),
                                           ("--frames", frames is not None)) if given]
    if onnx_only and format in ("safetensors", "lerobot"):
        raise VlaforgeError(f"{', '.join(onnx_only)} apply to --format onnx|executorch (packages), not to "
                            f"--format {format}; drop them or give --format onnx")
    given = [f"--lerobot-{k}" for k, v in (("tokenizer", lerobot_tokenizer), ("vlm", lerobot_vlm),
                                            ("sizes", lerobot_sizes)) if v is not None]
    if given and format != "lerobot":
        raise VlaforgeError(f"{given[0]} applies to --format lerobot; drop it")
    if format == "lerobot":
        if out is None:
            raise VlaforgeError("--format lerobot needs --out DIR (the LeRobot policy folder to write)")
        from vlaforge.checkpoints import lerobot_folder as lerobot

        settings = lerobot_settings(checkpoint, tokenizer=lerobot_tokenizer, vlm=lerobot_vlm, sizes=lerobot_sizes)
        typer.echo(lerobot.render(lerobot.export_lerobot(checkpoint, out, lerobot=settings)))
        return
    if format != "safetensors" or is_lerobot_folder(checkpoint):  # a LeRobot folder is one safetensors file already
        refuse_lerobot_policy(checkpoint, f"vlaforge export --format {format}", runs=format != "onnx",
                              instead=", --format onnx a package of a run fine-tuned from it")
    if format == "safetensors":
        path = export_weights(resolve_checkpoint(str(checkpoint), ".", what="CHECKPOINT"), out)
        typer.echo(f"wrote {path}")
        return
    if out is None:
        raise VlaforgeError(f"--format {format} needs --out DIR (the package folder to write)")
    from vlaforge.export.package import export_package, render

    if calibrate is not None and not quantized:
        raise VlaforgeError("--calibrate sets the calibration frames of --quantized; drop it or add --quantized")
    report = export_package(checkpoint, out, format=format, dtype=dtype, int8=quantized,
                            calibrate=256 if calibrate is None else calibrate, frames=32 if frames is None else frames,
                            data=data)
    typer.echo(render(report))


_MODE = "none, fp16, bf16, int8, int8_dynamic, int4, int3, int2"


@app.command()
def quantize(checkpoint: Path = typer.Argument(..., help="a float run folder (its latest checkpoint) or a "
                                                         "checkpoints/step_* folder"),
             out: Path = typer.Option(..., help="the quantized checkpoint folder to write (eval / serve load it); "
                                                "an existing one is replaced only if `vlaforge quantize` wrote it, "
                                                "unchanged"),
             vision: Optional[str] = typer.Option(None, help=f"vision tower: {_MODE}; default: the run's "
                                                             "components.vision.qat, else none"),
             projector: Optional[str] = typer.Option(None, help="projector; default as --vision"),
             llm: Optional[str] = typer.Option(None, help="language model; default as --vision"),
             action_head: Optional[str] = typer.Option(None, help="action head; anything but none needs "
                                                                  "--allow-action-head"),
             group_size: int = typer.Option(32, min=2, help="weights per scale of int4 / int3 / int2"),
             algorithm: str = typer.Option("affine", help="int4/3/2 scales: affine (min-max) or hqq (HQQ "
                                                          "scale-only)"),
             calibrate: int = typer.Option(0, min=0, help="calibration frames: pick each intx component's scale "
                                                          "algorithm by action error on them (0: off)"),
             frames: int = typer.Option(64, min=1, help="dataset frames the action error and latency are measured "
                                                        "on"),
             data: Optional[str] = typer.Option(None, help="dataset of those frames (a held-out one; default the "
                                                           "run's data.path)"),
             allow_action_head: bool = typer.Option(False, help="permit quantizing the action head"),
             eval_: bool = typer.Option(False, "--eval", help="closed-loop success per task, float and quantized"),
             episodes: int = typer.Option(50, min=1, help="--eval: episodes per task"),
             workers: int = typer.Option(2, min=1, help="--eval: rollout processes"),
             progress: bool = typer.Option(True, help="show a progress bar")):
    """Quantize a trained policy per component with torchao (e.g. --vision int8 --projector fp16 --llm int4) into a
    checkpoint folder that eval, serve and PolicyRuntime load; writes quantize.json (bytes per component, latency,
    action error against the float policy, with --eval closed-loop success of both)."""
    from vlaforge.checkpoints.layout import local_checkpoint, refuse_lerobot_policy
    from vlaforge.evaluation.quantization import QuantizeOptions, quantize_run, render

    refuse_lerobot_policy(local_checkpoint(checkpoint), "vlaforge quantize")
    modes = {"vision": vision, "projector": projector, "llm": llm, "action_head": action_head}
    report = quantize_run(checkpoint, out, QuantizeOptions(
        modes, group_size=group_size, algorithm=algorithm, calibrate=calibrate, frames=frames, data=data,
        allow_action_head=allow_action_head, eval_episodes=episodes if eval_ else 0, eval_workers=workers,
        progress=progress))
    typer.echo(render(report))
    typer.echo(f"wrote {out} (report: {report['report']})")
