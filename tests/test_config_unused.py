"""Nothing set is silently ignored (config/unused.py): a value the chosen configuration does not read is refused in one
line naming what would read it, a later layer's switch of an option drops the earlier layers' settings of the option
it left, and every recipe and a resolved (saved, resumed) config still load. LoRA over a random base is refused when
training starts (config/lora.py)."""

import pytest

from vlaforge.config import dump_toml, load_config
from vlaforge.errors import ConfigError, VlaforgeError

from conftest import TINY_RECIPE, run_cli
from test_safety import one_line

RECIPES = TINY_RECIPE.parent
LEROBOT = ["--data.source=lerobot", "--data.path=/d"]
TEACHER = ["--distill.teacher=/t"]
FP16 = ["--components.llm.precision=fp16"]


def test_a_dataset_path_on_synthetic_data_is_refused_not_trained(tmp_path):
    """The first case, as a new user meets it: before, this trained on synthetic data with exit 0."""
    proc = run_cli("train", str(TINY_RECIPE), "--data.path=/nonexistent", "--train.steps=1",
                   f"--train.output_dir={tmp_path / 'run'}")
    one_line(proc, "data.path = '/nonexistent' is set but data.source = 'synthetic' does not read a dataset",
             "drop it or set data.source = 'lerobot'")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, expected", [
    (["--data.text_column=annotation.phase"], "data.text_column = 'annotation.phase' is set but data.source = "
                                              "'synthetic' does not read a dataset"),
    (["--data.frame_stride=2"], "data.frame_stride = 2 is set but data.source = 'synthetic'"),
    (["--data.augment_shift=0"], "data.augment_shift = 0 is set but data.source = 'synthetic'"),
    (["--data.augment_color=0.2"], "data.augment_color = 0.2 is set but data.source = 'synthetic'"),
    (["--data.cache_mb=10"], "data.cache_mb = 10.0 is set but data.source = 'synthetic'"),
    ([*LEROBOT, "--data.num_samples=64"], "data.num_samples = 64 is set but data.source = 'lerobot' reads"),
    ([*LEROBOT, "--data.num_tasks=2"], "data.num_tasks = 2 is set but data.source = 'lerobot'"),
    ([*LEROBOT, "--data.frame_stride=2"], "model.frames = 1 takes no history frames to space"),
    (["--model.max_cameras=1"], "model.max_cameras = 1 is set but it limits model.cameras = 'auto'"),
    ([*LEROBOT, '--model.cameras=["a","b"]', "--model.max_cameras=1"], "model.cameras names 2 cameras"),
    (["--model.env_state_dim=3"], "model.env_state_dim = 3 is set but it sizes the action head's probe of a "
                                  "dataset's observation.environment_state, and data.source = 'synthetic' has none"),
    ([*LEROBOT, "--model.env_state_dim=3"], "which only loss.weights.env_state > 0 trains"),
    (["--model.action_head.flow_steps=4"], "model.action_head.kind = 'regression' has no flow network"),
    (["--model.action_head.layers=3"], "model.action_head.layers = 3 is set but model.action_head.kind"),
    (["--components.llm.fp8_recipe=tensorwise"], "components.llm.precision = 'fp32' has no fp8 linears"),
    (["--components.vision.checkpoint_every_n=3"], "checkpointing = 'none' does not pick every n-th block"),
    (["--components.projector.offload=cpu", "--components.projector.offload_fraction=0.5"],
     "it picks transformer blocks and the projector has none"),
    (["--components.action_head.trainable=false", "--components.action_head.unfreeze_at_step=2",
      "--components.action_head.unfreeze_last_blocks=1"], "the action_head has none"),
    (["--components.llm.offload=cpu", "--components.llm.offload_path=/nvme"],
     "components.llm.offload = 'cpu' writes no files"),
    (["--components.llm.qat_group_size=64"], "components.llm.qat = 'none' fake-quantizes nothing"),
    (["--components.allow_fp8_vision=true"], "it permits components.vision.precision = 'fp8', which is 'fp32'"),
    (["--loss.action=l1", "--loss.huber_delta=0.5"], "loss.action = 'l1' is not the Huber loss"),
    (["--loss.dwa_temperature=1.0"], "loss.weighting = 'static' does not read it; drop it or set loss.weighting = "
                                     "'dwa'"),
    (["--loss.gradnorm_alpha=1.0"], "set loss.weighting = 'gradnorm'"),
    (["--loss.weighting=dwa", "--loss.weighting_lr=0.1"], "set loss.weighting = 'uncertainty' or 'gradnorm'"),
    (["--parallel.zero_stage=3"], "parallel.backend = 'fsdp2' does not run DeepSpeed ZeRO"),
    (["--parallel.zero_tuning={overlap_comm=true}"], "parallel.zero_tuning = {'overlap_comm': True} is set but"),
    (["--parallel.nvme_path=/nvme"], "parallel.nvme_path = '/nvme' is set but parallel.backend = 'fsdp2' never reads "
                                     "it"),
    (["--parallel.backend=deepspeed", "--parallel.nvme_path=/nvme"], "neither parallel.offload_optimizer nor"),
    (["--parallel.cp_method=ulysses"], "parallel.cp = 1 splits no sequence"),
    (["--train.lr_schedule=constant", "--train.min_lr_ratio=0.0"], "train.lr_schedule = 'constant' has no floor"),
    (["--train.precision_master=bf16"], "every component computes in fp32"),
    (["--train.lora_random_base=true"], "no LoRA component trains over a random base"),
    (['--components.llm.lora={rank=4,base="nf4"}', "--train.init_from=/r", "--train.lora_random_base=true"],
     "no LoRA component trains over a random base"),
    (["--eval.train_episodes=3"], "eval.every = 0 never evaluates during training"),
    (["--loss_scale.initial=512"], "loss_scale.mode = 'auto' scales only when a trainable component computes in "
                                   "fp16, and none does"),
    ([*FP16, "--loss_scale.mode=off", "--loss_scale.growth_interval=10"], "loss_scale.mode = 'off' never scales"),
    (["--numerics.zero_jump=0.5"], "no component computes in fp16"),
    ([*FP16, "--numerics.every=0", "--numerics.norm_ratio=0.01"], "numerics.every = 0 measures no gradients"),
    ([*FP16, "--numerics.check_finite=false"], "dynamic loss scaling is on here"),
    (["--distill.temperature=4"], "distill.temperature = 4.0 is set but distill.teacher is not set"),
    ([*TEACHER, "--distill.weights={kl=0}", "--distill.temperature=4"], "distill.weights.kl = 0 turns its term off"),
    ([*TEACHER, "--distill.weights={feature=0}", "--distill.layers=[[1,2]]"], "distill.weights.feature = 0"),
    ([*TEACHER, "--distill.weights={action=0}", "--distill.action=huber"], "distill.weights.action = 0"),
    ([*TEACHER, "--distill.flow_target=chunk"], "model.action_head.kind = 'regression' has no flow network"),
    ([*TEACHER, "--distill.init=teacher", "--train.init_from=/r"], "train.init_from already gives the student"),
])
def test_a_setting_the_configuration_does_not_read_is_refused(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TINY_RECIPE, overrides)
    assert expected in str(err.value) and "drop it" in str(err.value)
    assert "\n" not in str(err.value)


def test_every_unread_setting_is_named_in_the_one_line():
    with pytest.raises(ConfigError, match=r"^[^\n]*\(and 2 more: data.cache_mb, parallel.nvme_path\)$"):
        load_config(TINY_RECIPE, ["--data.path=/d", "--data.cache_mb=1", "--parallel.nvme_path=/n"])


def test_what_the_configuration_reads_or_leaves_at_its_default_loads():
    at_default = ["--data.text_column=auto", "--data.frame_stride=1", "--components.llm.fp8_recipe=rowwise",
                  "--parallel.zero_stage=2", "--loss.huber_delta=1.0", "--eval.train_episodes=10"]
    assert load_config(TINY_RECIPE, at_default).parallel.zero_stage == 2
    read = ["--model.action_head.kind=flow_matching", "--model.action_head.flow_steps=4",
            "--components.llm.offload=nvme", "--components.llm.offload_path=/nvme", "--parallel.backend=deepspeed",
            "--parallel.zero_stage=3", "--parallel.offload_optimizer=nvme", "--parallel.nvme_path=/n",
            *LEROBOT, "--model.frames=2", "--data.frame_stride=3", "--model.env_state_dim=3",
            "--loss.weights.env_state=0.5"]
    cfg = load_config(TINY_RECIPE, read)
    assert (cfg.data.frame_stride, cfg.parallel.nvme_path, cfg.components.llm.offload_path) == (3, "/n", "/nvme")
    lora = load_config(TINY_RECIPE, ['--components.llm.lora={rank=4,base="nf4"}', "--train.lora_random_base=true"])
    assert lora.train.lora_random_base
    # read with the config's own option off: by `profile --offload` and `plan`'s offload knob, and `plan`'s pp > 1
    # layouts
    load_config(TINY_RECIPE, ["--components.llm.offload_min_bytes=0", "--components.llm.offload_fraction=0.5",
                              "--parallel.pp_schedule=gpipe"])


def test_the_command_line_switching_an_option_drops_the_recipe_settings_of_the_one_it_left():
    """tiny_synthetic's num_samples under --data.source=lerobot (docs/lerobot.md's first command), the demo recipe's
    dataset settings under --data.source=synthetic: the resolved config holds what the run reads."""
    cfg = load_config(TINY_RECIPE, LEROBOT)
    assert cfg.data.num_samples == 1024
    demo = load_config(RECIPES / "tiny_metaworld.toml")
    cfg = load_config(RECIPES / "tiny_metaworld.toml", ["--data.source=synthetic", "--loss.weights.env_state=0"])
    assert (cfg.data.path, cfg.data.augment_shift, cfg.model.env_state_dim) == (None, 4, 0)
    assert (cfg.data.num_workers, cfg.model.cameras) == (demo.data.num_workers, demo.model.cameras)  # read by both


def test_a_recipe_that_sets_what_it_does_not_read_is_refused_and_a_child_recipe_may_switch(tmp_path):
    (tmp_path / "same.toml").write_text(f'base = "{TINY_RECIPE}"\n[data]\npath = "/d"\n')
    with pytest.raises(ConfigError, match="data.path = '/d' is set but data.source = 'synthetic'"):
        load_config(tmp_path / "same.toml")
    (tmp_path / "child.toml").write_text(f'base = "{TINY_RECIPE}"\n[data]\nsource = "lerobot"\npath = "/d"\n')
    assert load_config(tmp_path / "child.toml").data.num_samples == 1024  # the base's synthetic setting is left


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.toml")), ids=lambda p: p.name)
def test_every_recipe_loads_and_reloads_from_its_dump(recipe, tmp_path):
    cfg = load_config(recipe)
    (tmp_path / "config.toml").write_text(dump_toml(cfg))
    assert load_config(tmp_path / "config.toml") == cfg


def test_a_resolved_config_saved_by_a_run_reloads_for_resume(tmp_path):
    """What the trainer writes to config.toml - every field, the shapes and terms resolved from the dataset (cameras
    cut by max_cameras, the env_state term and its probe turned off where the column is missing) - loads again the
    way `train --resume` loads it."""
    from vlaforge.config.shapes import resolve_shapes, resolve_terms

    from fake_lerobot import write_dataset

    write_dataset(tmp_path / "ds", env_state=False)
    (tmp_path / "recipe.toml").write_text(
        f'base = "{RECIPES / "tiny_metaworld.toml"}"\n[model]\ncameras = "auto"\nmax_cameras = 1\n'
        f'[data]\npath = "{tmp_path / "ds"}"\n')
    cfg, _ = resolve_terms(resolve_shapes(load_config(tmp_path / "recipe.toml"))[0])
    assert (cfg.model.cameras, cfg.model.env_state_dim, cfg.data.text_column) == (["front"], 0, "annotation.phase")
    (tmp_path / "config.toml").write_text(dump_toml(cfg))
    again = load_config(tmp_path / "config.toml", ["--train.resume=latest", f"--train.output_dir={tmp_path}"])
    assert again.model_copy(update={"train": cfg.train}) == cfg


def test_lora_without_a_pretrained_base_is_refused_when_training_starts(tmp_path):
    """recipes/tiny_lora.toml without --train.init_from trained adapters over a random frozen base (exit 0)."""
    proc = run_cli("train", str(RECIPES / "tiny_lora.toml"), "--train.steps=1", f"--train.output_dir={tmp_path / 'r'}")
    one_line(proc, "components.vision.lora trains adapters over a frozen vision that would be random",
             "train.init_from = RUN", "model.vision.pretrained or model.vlm.pretrained", "train.lora_random_base")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("overrides, refused", [
    ([], "components.vision.lora"),
    (["--model.vision.pretrained=/v"], "components.llm.lora"),  # a folder for the tower only: the LLM's is random
    (["--model.vlm.pretrained=/v"], None),
    (["--train.init_from=/run"], None),
    (["--train.lora_random_base=true"], None),
])
def test_a_lora_component_needs_its_pretrained_base_or_the_opt_in(overrides, refused):
    from vlaforge.config.lora import check_pretrained_base

    cfg = load_config(RECIPES / "tiny_lora.toml", overrides)
    if refused is None:
        check_pretrained_base(cfg)
    else:
        with pytest.raises(VlaforgeError, match=refused):
            check_pretrained_base(cfg)
