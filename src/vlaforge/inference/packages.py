"""The package backends of `PolicyRuntime`: an exported policy package (`vlaforge export --format onnx` or
`executorch`, see `export/onnx.py` for the format) behind the same two regions as a checkpoint - `encode_frames`
(vision tower + projector, one frame per row; its output is what the frame-feature cache keeps) and
`actions_from_tokens` - so `vlaforge eval` and `vlaforge serve` run a package exactly like a checkpoint. The graphs
run in ONNX Runtime (`.onnx`) or in ExecuTorch's runtime (`.pte`, XNNPACK delegate), as the manifest's `runtime`
says.

Nothing of vlaforge's model code runs: the observation contract and normalization come from `manifest.json`, the
tokenizer from `tokenizer.json` with the manifest's pad / eos ids, and the graphs from their files, each checked
against the manifest's sha256, inputs and outputs before the first prediction. A flow-matching package is integrated
with the manifest's Euler steps by the same function the PyTorch head uses (`models.action_heads.euler_sample`; a
LeRobot policy's package by the policy's own, `models.policies.model.flow_euler`, over its cached prefix keys and
values: `export/policy.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlaforge.errors import VlaforgeError, first_line
from vlaforge.outputs import file_sha256

MANIFEST = "manifest.json"
FORMAT = "vlaforge.onnx-policy"
FORMAT_VERSION = 2  # 2 (2026-12-03): the tokenizer's file is hashed like the graphs'
ONNX_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64"}
# the graphs of each head: name -> (inputs, outputs)
GRAPHS = {
    "regression": {"vision": (["pixels"], ["tokens"]),
                   "policy": (["tokens", "ids", "mask", "state"], ["actions"])},
    "flow_matching": {"vision": (["pixels"], ["tokens"]),
                      "encoder": (["tokens", "ids", "mask", "state"], ["condition"]),
                      "denoise": (["x_t", "t", "condition"], ["velocity"])},
    "flow_matching_kv": {"vision": (["pixels"], ["tokens"]),  # a LeRobot policy's (export/policy.py)
                         "prefix": (["tokens", "ids", "mask", "state"], ["prefix_kv", "prefix_mask"]),
                         "denoise": (["x_t", "t", "state", "prefix_kv", "prefix_mask"], ["velocity"])},
}
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
RUNTIMES = {"onnxruntime": "onnx", "executorch": "executorch"}  # manifest runtime -> PolicyRuntime backend
PTE_DTYPES = {6: "float32", 5: "float16", 4: "int64"}  # ExecuTorch ScalarType codes
_FIX = "export the run again with `vlaforge export RUN --format onnx --out DIR`"


def is_package(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The package's manifest, checked for its format and fields, each graph's files present with their sha256.

    Raises:
        VlaforgeError: one line naming what is wrong (no manifest, not JSON, another format or version, a missing
            field or file, a file whose hash differs from the manifest's).
    """
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise VlaforgeError(f"{folder} is not an exported policy package (no {MANIFEST}); {_FIX}")
    try:
        m = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise VlaforgeError(f"{path} is not JSON ({first_line(exc)}); {_FIX}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise VlaforgeError(f"{path} is not a {FORMAT} manifest; {_FIX}")
    if m.get("format_version") != FORMAT_VERSION:
        raise VlaforgeError(f"{path}: format_version {m.get('format_version')!r}, this vlaforge reads "
                            f"{FORMAT_VERSION}; {_FIX}")
    for key in ("observation", "tokenizer", "action_head", "graphs", "dtype"):
        if key not in m:
            raise VlaforgeError(f"{path} has no {key!r}; {_FIX}")
        if key != "dtype" and not isinstance(m[key], dict):
            raise VlaforgeError(f"{path}: {key!r} is a JSON {type(m[key]).__name__}, not an object; {_FIX}")
    head = m["action_head"].get("kind")
    if head not in GRAPHS or set(m["graphs"]) != set(GRAPHS[head]):
        raise VlaforgeError(f"{path}: action head {head!r} with graphs {sorted(m['graphs'])}; a package holds "
                            f"{', '.join(GRAPHS.get(head, GRAPHS['regression']))}; {_FIX}")
    if m.get("runtime", "onnxruntime") not in RUNTIMES:
        raise VlaforgeError(f"{path}: runtime {m.get('runtime')!r} is not one of {', '.join(RUNTIMES)}; {_FIX}")
    if m["dtype"] not in TORCH_DTYPES:
        raise VlaforgeError(f"{path}: dtype {m['dtype']!r} is not one of {', '.join(TORCH_DTYPES)}; {_FIX}")
    for name, g in m["graphs"].items():
        _check_hashed(folder, path, f"graph {name}", g)
    _check_hashed(folder, path, "tokenizer", m["tokenizer"])
    return m


def _check_hashed(folder: Path, path: Path, what: str, entry: Any) -> None:
    """NOTE: the one rule for every file a package loads: `entry["file"]` is one of the files `entry["sha256"]`
    hashes, each a plain name inside the package folder, present, with the manifest's digest."""
    hashes = entry.get("sha256") if isinstance(entry, dict) else None
    if not isinstance(hashes, dict) or not hashes or not all(isinstance(v, str) for v in hashes.values()):
        raise VlaforgeError(f"{path}: {what} has no sha256 object of file names to digests; {_FIX}")
    if not isinstance(entry.get("file"), str) or entry["file"] not in hashes:
        raise VlaforgeError(f"{path}: {what} loads {entry.get('file')!r}, which is not one of the files its sha256 "
                            f"covers; {_FIX}")
    for file, digest in hashes.items():
        if Path(file).name != file or file.startswith("."):
            raise VlaforgeError(f"{path}: {what} names the file {file!r} outside the package; {_FIX}")
        if not (folder / file).is_file():
            raise VlaforgeError(f"{folder}: {file} ({what}) is missing; {_FIX}")
        if file_sha256(folder / file) != digest:
            raise VlaforgeError(f"{folder / file}: sha256 differs from the manifest's (the file was changed or "
                                f"is truncated); {_FIX}")


def signature(session) -> dict[str, dict[str, Any]]:
    """{"inputs": {name: {dtype, shape}}, "outputs": ...} of an ONNX Runtime session, as the manifest writes it."""
    arg = lambda a: {"dtype": ONNX_TYPES.get(a.type, a.type), "shape": list(a.shape)}
    return {"inputs": {a.name: arg(a) for a in session.get_inputs()},
            "outputs": {a.name: arg(a) for a in session.get_outputs()}}


def pte_signature(method, inputs: list[str], outputs: list[str]) -> dict[str, dict[str, Any]]:
    """The same for an ExecuTorch method: a .pte keeps no argument names (the graph's order is the manifest's) and
    holds the batch dimension at its planned maximum, written back as "batch"."""
    meta = method.metadata

    def arg(t):
        sizes = list(t.sizes())
        return {"dtype": PTE_DTYPES.get(t.dtype(), str(t.dtype())), "shape": ["batch", *sizes[1:]]}

    return {"inputs": {n: arg(meta.input_tensor_meta(i)) for i, n in enumerate(inputs[:meta.num_inputs()])},
            "outputs": {n: arg(meta.output_tensor_meta(i)) for i, n in enumerate(outputs[:meta.num_outputs()])}}


def _check_graph(folder: Path, entry: dict[str, Any], have: dict[str, dict[str, Any]]) -> None:
    """The graph's inputs and outputs as its runtime reads them must be the manifest's (names, dtypes, shapes)."""
    for kind in ("inputs", "outputs"):
        got, want = have[kind], entry[kind]
        diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        if diff:
            raise VlaforgeError(f"{folder / entry['file']}: {kind} {', '.join(diff)} are "
                                f"{[got.get(k) for k in diff]} in the graph but {[want.get(k) for k in diff]} in the "
                                f"manifest; {_FIX}")


def _check_contract(path: Path, m: dict[str, Any]) -> None:
    """The observation contract must be the one the graphs take (image size, tokens per history, instruction
    length, state and action sizes, chunk)."""
    o, g, h = m["observation"], m["graphs"], m["action_head"]
    vision_in, vision_out = g["vision"]["inputs"]["pixels"]["shape"], g["vision"]["outputs"]["tokens"]["shape"]
    body = g.get("policy") or g.get("encoder") or g["prefix"]
    out = g["policy"]["outputs"]["actions"]["shape"] if "policy" in g else g["denoise"]["outputs"]["velocity"]["shape"]
    tokens = len(o["cameras"]) * o["frames"] * vision_out[1]
    checks = [("image_size", o["image_size"], vision_in[2:], [o["image_size"]] * 2),
              ("cameras x frames x patches", tokens, body["inputs"]["tokens"]["shape"][1], tokens),
              ("instruction_tokens", o["instruction_tokens"], body["inputs"]["ids"]["shape"][1],
               o["instruction_tokens"]),
              ("state size", len(o["state_mean"]), body["inputs"]["state"]["shape"][1], len(o["state_mean"]))]
    for what, said, graph, want in checks:
        if graph != want:
            raise VlaforgeError(f"{path}: the manifest's {what} is {said} but the graphs take {graph}; {_FIX}")
    said, head = [o["chunk"], len(o["action_mean"])], [h["chunk"], h["action_dim"]]
    width = h.get("noise_dim", h["action_dim"])  # the width the graphs integrate: a policy's padded actions
    if said != head or out[1:] != [h["chunk"], width]:
        raise VlaforgeError(f"{path}: the manifest's chunk x action size is {said} (action head {head}, integrated "
                            f"width {width}) but the graphs give {out[1:]}; {_FIX}")


def _to_numpy(x: torch.Tensor, dtype=None) -> np.ndarray:
    a = x.detach().cpu().numpy()
    return np.ascontiguousarray(a if dtype is None else a.astype(dtype, copy=False))


class OrtGraph:
    """One graph in an ONNX Runtime session: `graph(feed) -> outputs` (numpy)."""

    def __init__(self, path: Path, device: str):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()  # the process's budget (eval workers set theirs)
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), options, providers=providers(device))
        self.providers = self.session.get_providers()

    def signature(self, entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return signature(self.session)

    def __call__(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(None, feed)


class PteGraph:
    """One graph as an ExecuTorch program (XNNPACK-delegated) run by ExecuTorch's Python runtime."""

    def __init__(self, path: Path, device: str):
        if device not in ("auto", "cpu"):
            raise VlaforgeError(f"--device {device}: an ExecuTorch package runs on the CPU (XNNPACK); use --device "
                                "cpu")
        from executorch.runtime import Runtime

        self.method = Runtime.get().load_program(str(path)).load_method("forward")
        self.providers = ["ExecuTorch XNNPACK"]
        self.order: list[str] = []

    def signature(self, entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
        self.order = list(entry["inputs"])
        return pte_signature(self.method, self.order, list(entry["outputs"]))

    def __call__(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [t.numpy() for t in self.method.execute([torch.from_numpy(feed[k]) for k in self.order])]


class PackageRegions:
    """A package's graphs as the runtime's two regions (the torch model's `encode_frames` / `actions_from_tokens`
    signatures, torch tensors in and out)."""

    def __init__(self, folder: Path, manifest: dict[str, Any], graphs: dict[str, Any]):
        self.folder, self.manifest, self.graphs = folder, manifest, graphs
        self.backend = RUNTIMES[manifest.get("runtime", "onnxruntime")]
        self.dtype = TORCH_DTYPES[manifest["dtype"]]
        self._np_dtype = np.float16 if manifest["dtype"] == "fp16" else np.float32
        head = manifest["action_head"]
        self.kind, self.chunk, self.action_dim = head["kind"], head["chunk"], head["action_dim"]
        self.flow_steps, self.noise_dim = head.get("flow_steps", 0), head.get("noise_dim", self.action_dim)
        self.length = manifest["observation"]["instruction_tokens"]
        self.pad_id = manifest["tokenizer"]["pad_id"]

    @property
    def supports_prefix(self) -> bool:
        return self.kind == "flow_matching"

    def encode_frames(self, pixels: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.graphs["vision"]({"pixels": _to_numpy(pixels, self._np_dtype)})[0])

    def actions_from_tokens(self, vision_tokens: torch.Tensor, instruction_ids: torch.Tensor,
                            instruction_mask: torch.Tensor | None, state: torch.Tensor,
                            prefix: torch.Tensor | None = None,
                            prefix_weight: torch.Tensor | None = None) -> torch.Tensor:
        b, n = instruction_ids.shape
        ids = np.full((b, self.length), self.pad_id, np.int64)
        mask = np.zeros((b, self.length), np.int64)
        ids[:, :n] = _to_numpy(instruction_ids)
        mask[:, :n] = 1 if instruction_mask is None else _to_numpy(instruction_mask).astype(np.int64)
        feed = {"tokens": _to_numpy(vision_tokens, self._np_dtype), "ids": ids, "mask": mask,
                "state": _to_numpy(state, self._np_dtype)}
        if self.kind == "regression":
            return torch.from_numpy(self.graphs["policy"](feed)[0])
        if self.kind == "flow_matching_kv":
            return self.policy_actions(feed)
        from vlaforge.models.action_heads import euler_sample

        cond = torch.from_numpy(self.graphs["encoder"](feed)[0])
        denoise = self.graphs["denoise"]

        def velocity(x_t: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(denoise({"x_t": _to_numpy(x_t, self._np_dtype), "t": _to_numpy(t, self._np_dtype),
                                             "condition": _to_numpy(c, self._np_dtype)})[0])

        return euler_sample(velocity, cond, self.chunk, self.action_dim, self.flow_steps, prefix, prefix_weight)

    def policy_actions(self, feed: dict[str, np.ndarray], noise: torch.Tensor | None = None) -> torch.Tensor:
        """A LeRobot policy's chunk: the prefix graph once, then the policy's Euler steps over the denoising graph
        from `noise` (B, T, noise_dim) (default: drawn as the PyTorch policy draws it), cropped to the actions."""
        from vlaforge.models.policies.model import flow_euler

        kv, pad = self.graphs["prefix"](feed)
        denoise, state = self.graphs["denoise"], feed["state"]
        if noise is None:
            noise = torch.randn(state.shape[0], self.chunk, self.noise_dim)
        noise = noise.to(self.dtype)

        def velocity(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(denoise({"x_t": _to_numpy(x_t, self._np_dtype), "t": _to_numpy(t, self._np_dtype),
                                             "state": state, "prefix_kv": kv, "prefix_mask": pad})[0])

        return flow_euler(velocity, noise, self.flow_steps)[:, :, :self.action_dim]

    def describe(self) -> dict[str, Any]:
        m = self.manifest
        return {"package": str(self.folder), "runtime": m.get("runtime", "onnxruntime"), "graphs": sorted(m["graphs"]),
                "dtype": m["dtype"], "providers": sorted({p for g in self.graphs.values() for p in g.providers}),
                "quantization": m.get("quantization"), "source": m.get("source", {}).get("checkpoint")}


def providers(device: str) -> list[str]:
    import onnxruntime as ort

    if device in ("auto", "cpu"):
        return ["CPUExecutionProvider"]
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise VlaforgeError(f"--device {device}: this onnxruntime has no CUDA execution provider (pip install "
                                "onnxruntime-gpu); use --device cpu")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    raise VlaforgeError(f"--device {device!r} is not one of auto, cpu, cuda for an ONNX package")


def load_package(folder: str | Path, device: str = "auto", backend: str = "auto"):
    """(PackageRegions, ObservationSpec, TextTokenizer) of a package, every file checked against the manifest.
    `backend` (onnx / executorch) must be the package's runtime when given.

    Raises:
        VlaforgeError: the package is incomplete or changed (see `read_manifest`), a graph does not match the
            manifest, the runtime is missing or another than asked for, or it cannot load a graph.
    """
    from tokenizers import Tokenizer

    from vlaforge.data.tokenizer import TextTokenizer
    from vlaforge.data.transforms import ObservationSpec

    folder = Path(folder)
    m = read_manifest(folder)
    runtime = m.get("runtime", "onnxruntime")
    if backend not in ("auto", RUNTIMES[runtime]):
        raise VlaforgeError(f"{folder} is a {runtime} package; run it with --backend {RUNTIMES[runtime]} (or auto)")
    graph_class = OrtGraph if runtime == "onnxruntime" else PteGraph
    try:
        __import__("onnxruntime" if runtime == "onnxruntime" else "executorch.runtime")
    except ImportError:
        raise VlaforgeError(f"this package runs in {runtime}, which is not installed (pip install "
                            f"{'onnxruntime' if runtime == 'onnxruntime' else 'executorch'})") from None
    try:
        spec = ObservationSpec(**m["observation"])
    except TypeError as exc:
        raise VlaforgeError(f"{folder / MANIFEST}: observation fields do not fit ({first_line(exc)}); {_FIX}") from None
    tok_file = folder / m["tokenizer"]["file"]
    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception on bad files
        raise VlaforgeError(f"{tok_file} is not a tokenizer file ({first_line(exc)[:120]}); {_FIX}") from None
    style = m["tokenizer"].get("style") or {}  # a LeRobot policy's: its newline, BOS, no eos, pi0.5's state prompt
    for key in ("pad_id", "eos_id"):
        value = m["tokenizer"].get(key)
        if key == "eos_id" and value is None and style.get("eos") is False:
            continue
        if type(value) is not int or not 0 <= value < tok.get_vocab_size():
            raise VlaforgeError(f"{folder / MANIFEST}: tokenizer {key} {value!r} is not an id of its "
                                f"{tok.get_vocab_size()}-token vocabulary; {_FIX}")
    tokenizer = TextTokenizer.styled(tok, m["tokenizer"]["pad_id"], m["tokenizer"]["eos_id"], style)
    graphs = {}
    for name, entry in m["graphs"].items():
        try:
            graphs[name] = graph_class(folder / entry["file"], device)
            have = graphs[name].signature(entry)
        except VlaforgeError:
            raise
        except Exception as exc:  # noqa: BLE001 - onnxruntime / executorch raise their own exception types
            raise VlaforgeError(f"{runtime} cannot load {folder / entry['file']} ({first_line(exc)[:200]}); "
                                f"{_FIX}") from None
        _check_graph(folder, entry, have)
    _check_contract(folder / MANIFEST, m)
    return PackageRegions(folder, m, graphs), spec, tokenizer
