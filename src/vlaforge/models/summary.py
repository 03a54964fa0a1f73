"""Per-component parameter counts and bytes of a flavor, built under fake tensors."""

from __future__ import annotations

from vlaforge import COMPONENTS


def _rows(counts: dict[str, int], nominal: dict[str, float]) -> dict[str, dict]:
    rows = {}
    for name in (*COMPONENTS, "total"):
        row = {"params": counts[name], "fp32_bytes": 4 * counts[name], "bf16_bytes": 2 * counts[name]}
        if name in nominal:
            row["nominal_params"] = int(nominal[name])
        rows[name] = row
    return rows


def summarize(flavor: str, vision_stem: str = "patch", vlm: str | None = None) -> dict:
    """{'flavor', 'components': {name: {'params', 'fp32_bytes', 'bf16_bytes', 'nominal_params'?}}, 'total'};
    `vision_stem`: model.vision_stem (a conv stem has more vision parameters than a patch embedding); `vlm`: a
    whole VLM folder (model.vlm.pretrained) whose tower, connector and language model the components are. A
    LeRobot policy flavor (pi0, pi05, smolvla) adds 'policy' (its LeRobot type) and, where LeRobot's module holds
    parameters vlaforge does not build, 'lerobot': {'dropped': {what: params}, 'total'}."""
    from vlaforge.config.flavors import FLAVORS
    from vlaforge.config.schema import ModelConfig
    from vlaforge.errors import VlaforgeError
    from vlaforge.models.build import build_vla, parameter_counts

    if flavor not in FLAVORS:
        raise VlaforgeError(FLAVORS.unknown_message(flavor))
    spec = FLAVORS.get(flavor)
    if spec.policy:
        if vision_stem != "patch" or vlm is not None:
            raise VlaforgeError(f"the {flavor} flavor is LeRobot's {spec.policy} policy at its own sizes; "
                                "--vision-stem and --vlm do not apply to it: drop them (or use the "
                                f"{spec.vlm_flavor} flavor)")
        return _policy_summary(flavor)
    try:
        model_cfg = ModelConfig(flavor=flavor, vision_stem=vision_stem, vlm={"pretrained": vlm})
    except ValueError as exc:  # pydantic's ValidationError: the stem does not fit the flavor
        from vlaforge.config.loading import format_validation_error

        raise VlaforgeError(format_validation_error(exc)) from None
    rows = _rows(parameter_counts(build_vla(model_cfg, fake=True)), spec.nominal_params)
    if vlm is not None:
        from vlaforge.models.vlm import vlm_family

        fam, _ = vlm_family(vlm)
        rows = {name: {k: v for k, v in row.items() if k != "nominal_params"} for name, row in rows.items()}
        return {"flavor": flavor, "vlm": vlm, "vision_stem": vision_stem, "components": rows,
                "description": f"{vlm}: a {fam.name} VLM mapped onto the components (the action head from "
                               f"the {flavor} flavor)"}
    return {"flavor": flavor, "vision_stem": vision_stem, "description": spec.description, "components": rows}


def _policy_summary(flavor: str) -> dict:
    """The summary of a LeRobot policy flavor: its architecture, its components, what LeRobot holds besides."""
    from vlaforge.config.flavors import FLAVORS
    from vlaforge.models.build import build_policy_flavor, parameter_counts
    from vlaforge.models.policies.defaults import default_policy

    spec = FLAVORS.get(flavor)
    defaults = default_policy(spec.policy)
    counts = parameter_counts(build_policy_flavor(flavor, fake=True))
    out = {"flavor": flavor, "policy": spec.policy, "description": defaults.architecture,
           "components": _rows(counts, spec.nominal_params)}
    if defaults.dropped:
        out["lerobot"] = {"dropped": dict(defaults.dropped),
                          "total": counts["total"] + sum(defaults.dropped.values())}
    return out


def render_summary(summary: dict) -> str:
    lines = [f"{summary['flavor']}: {summary['description']}",
             f"{'component':<12} {'params':>16} {'fp32 GB':>10} {'bf16 GB':>10} {'nominal':>12}"]
    for name, row in summary["components"].items():
        nominal = f"{row['nominal_params'] / 1e9:.3f}B" if "nominal_params" in row else ""
        lines.append(f"{name:<12} {row['params']:>16,} {row['fp32_bytes'] / 1e9:>10.3f} "
                     f"{row['bf16_bytes'] / 1e9:>10.3f} {nominal:>12}")
    lerobot = summary.get("lerobot")
    if lerobot:
        dropped = ", ".join(f"{what} ({n:,})" for what, n in lerobot["dropped"].items())
        lines.append(f"LeRobot's module also holds {dropped}, never used, which vlaforge does not build: "
                     f"{lerobot['total']:,} parameters in LeRobot")
    return "\n".join(lines)
