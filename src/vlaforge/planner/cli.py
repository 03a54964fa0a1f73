"""The pieces of `vlaforge plan` between the command line and the planner: the base config from a flavor or a
recipe plus the input flags, the cluster, and one run (search or fixed evaluation, report, measurement, recipe,
chart)."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vlaforge.errors import VlaforgeError
from vlaforge.planner.report import CHART_SOFTWARE
from vlaforge.planner.search import RECIPE_HEADER, parse_fixes, search, unplannable, write_config
from vlaforge.planner.types import Assumptions, Cluster, PlanModel


def assumptions(matmul_efficiency: float | None) -> Assumptions:
    return Assumptions() if matmul_efficiency is None else Assumptions(matmul_efficiency=matmul_efficiency)


def cluster(gpu: str, gpus_per_node: int, nodes: int, cpu_mem_gb: float, nvme_gb: float, nvme_gbps: float,
            catalog: Path | None) -> Cluster:
    from vlaforge.planner.hardware import get_gpu, load_catalog

    return Cluster(get_gpu(gpu, load_catalog(catalog)), gpus_per_node, nodes, cpu_mem_gb, nvme_gb, nvme_gbps)


def base_config(model: str, frames: int | None, cameras: int | None, image_size: int | None,
                text_tokens: int | None, seq: int | None):
    """The config every candidate starts from: a flavor's defaults or a recipe, with the input flags applied."""
    from vlaforge.config.flavors import FLAVORS
    from vlaforge.config.loading import deep_merge, load_config
    from vlaforge.models.build import with_seq_len

    if model.endswith(".toml"):
        from vlaforge.config.shapes import resolve_shapes

        cfg = resolve_shapes(load_config(Path(model)))[0]  # a plan needs the camera count
    elif model in FLAVORS:
        cfg = load_config(None, {"model": {"flavor": model}})
    else:
        raise VlaforgeError(f"--model {model!r} is neither a flavor ({', '.join(FLAVORS)}) nor a .toml recipe")
    update: dict[str, Any] = {"model": {}, "data": {}}
    if frames is not None:
        update["model"]["frames"] = frames
    if cameras is not None:
        update["model"]["cameras"] = [f"camera{i}" for i in range(cameras)]
    if image_size is not None:
        update["model"]["image_size"] = image_size
    if text_tokens is not None:
        update["data"]["max_instruction_tokens"] = text_tokens
    cfg = load_config(None, deep_merge(cfg.model_dump(mode="json", exclude_none=True), update))
    return with_seq_len(cfg, seq)


def run(base, cl: Cluster, global_batch: int, fix: list[str], micro_batch: int | None, assume: Assumptions,
        top: int, measure: bool, write_to: Path | None, plot_to: Path | None, lora_rank: int | None = None) -> dict:
    """Search (or evaluate the one configuration `fix` pins completely), then report; returns text and JSON."""
    from vlaforge.planner.report import plan_json, plot, render

    fixed = parse_fixes(fix)
    if micro_batch is not None:
        fixed["train.batch_size"] = micro_batch
    for path, flag, ours in ((write_to, "--write-config", _our_recipe), (plot_to, "--plot", _our_chart)):
        if path is not None:  # before the search: a refusal costs nothing and writes nothing
            writable(path, flag, ours)
    pm = PlanModel(base)
    plan = search(pm, cl, global_batch, fixed, assume, keep=top, lora_rank=lora_rank)
    if not plan.considered:
        raise VlaforgeError(unplannable(pm, cl, global_batch, fixed, lora_rank))
    out = plan_json(pm, plan, assume)
    text = render(plan, top)
    ref = out["reference"]
    if ref:
        text += (f"\nreference, one micro-batch of {ref['micro_batch']} through the LLM blocks (tp {ref['tp']}, "
                 f"{ref['checkpointing']}): Korthikanti et al. 2022 {ref['korthikanti_llm_blocks_gb']:.2f} GB, "
                 f"vlaforge {ref['vlaforge_llm_blocks_gb']:.2f} GB (the formula assumes MHA, a 4h GELU FFN, "
                 "half-precision residuals and materialized attention scores)")
    best = plan.best
    if best is None and plan.fallback is not None:  # nothing fits as searched: the fastest alternative that does
        name, best = plan.fallback
        text += f"\nchosen: {name} (the fastest alternative that fits)"
        out["chosen_alternative"] = name
    if best is None and (write_to or plot_to or measure):
        text += "\nnothing fits: no recipe, chart or measurement written"
    if best is not None:
        if write_to is not None:
            with _writing(write_to, "--write-config"):
                text += f"\nwrote {write_config(best, write_to, cl)}"
            out["wrote_config"] = str(write_to)
        if plot_to is not None:
            with _writing(plot_to, "--plot"):
                text += f"\nwrote {plot(best, plot_to, f'{base.model.flavor} on {cl.describe()}')}"
            out["wrote_plot"] = str(plot_to)
        if measure:
            rows = measured(best)
            out["measure"] = rows
            text += "\n" + render_measure(rows)
    return {"text": text, "json": out}


def writable(path: Path, flag: str, ours) -> None:
    """`path` can be written by plan: a new file in a folder it may create files in, or a file plan wrote before
    (`ours`); anything else is refused in one line, before anything is computed or written."""
    if path.exists() or path.is_symlink():
        if not path.is_file() or path.is_symlink() or not ours(path):
            raise VlaforgeError(f"{flag} {path} exists and was not written by vlaforge plan; choose another path or "
                                "remove it (plan replaces only its own files)")
    folder = path.parent
    while not folder.exists():  # write_atomic creates the missing folders
        folder = folder.parent
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise VlaforgeError(f"{flag} {path}: cannot write there ({e.strerror or e}); choose a writable path") from e


@contextmanager
def _writing(path: Path, flag: str):
    """An OS error while writing (a full disk, a folder gone read-only) as one line; write_atomic leaves no part."""
    try:
        yield
    except OSError as e:
        raise VlaforgeError(f"{flag} {path}: cannot write there ({e.strerror or e}); choose a writable path") from e


def _our_recipe(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(RECIPE_HEADER)) == RECIPE_HEADER.encode()
    except OSError:
        return False


def _our_chart(path: Path) -> bool:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return im.format == "PNG" and im.info.get("Software") == CHART_SOFTWARE
    except (OSError, UnidentifiedImageError):
        return False


def measured(e) -> dict:
    """The candidate's model under fake tensors: analytic vs measured activation bytes per component, for one
    micro-batch in one process (the planner's per-GPU shares divide these)."""
    from vlaforge.planner.measure import side_by_side

    return side_by_side(e.config, e.config.train.batch_size)


def render_measure(rows: dict) -> str:
    lines = [f"measured under fake tensors (one process, micro-batch {rows['micro_batch']}, "
             f"{rows['tokens_per_sample']} tokens/sample): activation GB analytic vs measured"]
    for comp, r in rows["by_component"].items():
        ratio = f"{r['ratio']:.4f}" if r["ratio"] else "-"
        lines.append(f"  {comp:<12} {r['analytic'] / 1e9:>10.3f} {r['measured'] / 1e9:>10.3f}  ratio {ratio}")
    a = rows["activations"]
    lines.append(f"  {'total':<12} {a['analytic'] / 1e9:>10.3f} {a['measured'] / 1e9:>10.3f}  ratio {a['ratio']:.4f}")
    lines.append(f"  (measured: on the device and offloaded together; offloaded {rows['offloaded_measured'] / 1e9:.3f} "
                 f"GB; autocast weight casts {rows['weight_casts_measured'] / 1e9:.3f} GB)")
    return "\n".join(lines)


def write_whitepaper(path: Path, global_batch: int, assume: Assumptions, catalog: Path | None) -> Path:
    from vlaforge.planner.hardware import load_catalog
    from vlaforge.planner.report import whitepaper, whitepaper_clusters

    return whitepaper(path, global_batch, assume, clusters=whitepaper_clusters(load_catalog(catalog)))

