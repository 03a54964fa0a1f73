"""`[lerobot]`: a run started by `vlaforge lerobot-train` (LeRobot 0.6.1's command line): the command as given, and
LeRobot's outputs beside vlaforge's own - `OUT/checkpoints/<step>/pretrained_model/` (a LeRobot policy folder that
`lerobot-eval --policy.path` and LeRobot's `from_pretrained` load) and the `checkpoints/last` link."""

from __future__ import annotations

from pydantic import Field

from vlaforge.config.base import Section


class LeRobotRunConfig(Section):
    layout: bool = Field(False, description="also write LeRobot's checkpoint layout at every checkpoint: "
                                            "checkpoints/<step, 6 digits>/pretrained_model/ (config.json, "
                                            "model.safetensors, both processor pipelines with the run's statistics, "
                                            "train_config.json) and checkpoints/last; a LeRobot policy fine-tune only")
    command: list[str] = Field(default_factory=list, description="the lerobot-train arguments the run was started "
                                                                 "with (vlaforge lerobot-train writes it)")
    translated: str | None = Field(None, description="the vlaforge train command line the lerobot-train command "
                                                     "became (written with it)")
    job_name: str | None = Field(None, description="LeRobot's --job_name (recorded)")
    repo_id: str | None = Field(None, description="LeRobot's --policy.repo_id: where the user pushes the result "
                                                  "(vlaforge does not upload; the run prints the hf upload command)")
