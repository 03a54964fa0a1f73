import pytest

from vlaforge.config import dump_toml, load_config, parse_overrides
from vlaforge.config.loading import validate
from vlaforge.errors import ConfigError

from conftest import TINY_RECIPE, run_cli


def test_recipe_loads_and_overrides_apply():
    cfg = load_config(TINY_RECIPE, ["--train.steps=10", "--model.cameras=[\"corner\",\"top\"]",
                                    "--components.llm.lr=2e-4", "--train.output_dir=/tmp/x"])
    assert cfg.train.steps == 10
    assert cfg.model.cameras == ["corner", "top"]
    assert cfg.model.frames_per_sample == 2 * cfg.model.frames
    assert cfg.components.llm.lr == 2e-4
    assert cfg.train.output_dir == "/tmp/x"


def test_fixed_key_names_exist():
    cfg = load_config(None, ["--model.flavor=tiny", "--model.vision.pretrained=/a", "--model.llm.pretrained=/b",
                             "--data.source=lerobot", "--data.path=/d", "--train.steps=3", "--train.output_dir=o",
                             "--train.resume=latest"])
    assert (cfg.model.vision.pretrained, cfg.model.llm.pretrained, cfg.data.path) == ("/a", "/b", "/d")
    assert cfg.train.resume == "latest"


def test_toml_round_trip():
    cfg = load_config(TINY_RECIPE, ["--train.steps=7"])
    import tomllib

    again = validate(tomllib.loads(dump_toml(cfg)))
    assert again == cfg


@pytest.mark.parametrize("override, expected", [
    ("--train.stepz=3", "unknown key train.stepz (did you mean 'steps'?)"),
    ("--train.steps=abc", "train.steps: Input should be a valid integer"),
    ("--model.flavor=tinyy", "unknown model flavor 'tinyy' (did you mean 'tiny'?)"),
    ("--loss.weighting=foo", "'static', 'uncertainty', 'dwa' or 'gradnorm'"),
    ("--components.vision.precision=fp8", "set components.allow_fp8_vision = true"),
    ("--components.action_head.precision=fp8", "action_head.precision = 'fp8' is refused"),
    ("--loss_scale.backoff_factor=2", "loss_scale.backoff_factor: Input should be less than 1"),
    ("--components.projector.checkpointing=selective", "no transformer blocks to checkpoint selectively"),
    ("--components.llm.offload=disk", "'none', 'cpu' or 'nvme'"),
    ("--components.llm.offload_fraction=0", "offload_fraction: Input should be greater than 0"),
    ("--parallel.pp_schedule=zero_bubble", "parallel.pp_schedule"),
    ("--parallel.backend=fsdp3", "parallel.backend"),
    ("--train.sync_every=3", "sync_every = 3 > grad_accum = 1 would step the optimizer with gradients never reduced"),
    ("--data.source=lerobot", "needs data.path"),
    ("--eval.execute=9", "eval.execute = 9 exceeds model.action_chunk = 8"),
    ("--eval.tasks=[\"reach-v2\"]", "did you mean 'reach-v3'"),
    ("--eval.every=5", "eval.every needs data.source = 'lerobot'"),
    ("--model.patch_size=12", "model.patch_size = 12 does not divide the image size 64"),
    ("--components.llm.unfreeze_at_step=5", "needs trainable = false"),
    ("--loss.weights={action=0}", "action term needs a weight > 0"),
    ("--model.action_head.kind=diffusion", "unknown action head 'diffusion'"),
])
def test_bad_values_name_field_and_fix(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TINY_RECIPE, [override])
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_malformed_override():
    with pytest.raises(ConfigError, match="--section.key=value"):
        parse_overrides(["train.steps=3"])


@pytest.mark.parametrize("args, expected", [
    (["train", "recipes/tiny_metaworld.toml", "--train.stepz=3"], "did you mean 'steps'"),
    (["train", "recipes/tiny_metaworld.toml", "--train.steps=x"], "train.steps"),
    (["train", "recipes/tiny_metaworld.toml", "--model.flavor=tinyy"], "did you mean 'tiny'"),
    (["train", "recipes/missing.toml"], "does not exist"),
    (["model", "summary", "vla7b"], "did you mean 'vla-7b'"),
])
def test_cli_bad_config_exits_2_with_one_line(args, expected):
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_config_show_prints_resolved_toml():
    proc = run_cli("config", "show", "recipes/tiny_metaworld.toml", "--train.steps=5",
                   "--components.llm.precision=bf16", fresh=True)
    assert proc.returncode == 0, proc.stderr
    import tomllib

    shown = tomllib.loads(proc.stdout)
    assert shown["train"]["steps"] == 5
    assert shown["components"]["llm"]["precision"] == "bf16"
    assert shown["components"]["action_head"]["lr"] == 1e-3  # from the recipe
    assert shown["loss"]["huber_delta"] == 1.0
    # tiny_metaworld: 2 cameras x (96 / 16)^2 patches + 12 instruction + 8 action queries + 8 text
    line = "# tokens per sample: 2 frames x 36 patches + 12 instruction + 8 action queries + 8 text = 100"
    assert line in proc.stdout


@pytest.mark.parametrize("recipe", sorted((TINY_RECIPE.parent).glob("*.toml")), ids=lambda p: p.name)
def test_every_recipe_validates(recipe):
    cfg = load_config(recipe)
    assert cfg.model.flavor


def test_a_recipe_is_its_base_plus_the_keys_it_changes(tmp_path):
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "child.toml").write_text('base = "../mid.toml"\n[train]\nsteps = 9\n')
    (tmp_path / "mid.toml").write_text(f'base = "{TINY_RECIPE}"\n[train]\nsteps = 5\nbatch_size = 3\n'
                                       '[components.llm]\nlr = 2e-4\n')
    child, plain = load_config(tmp_path / "parts" / "child.toml"), load_config(TINY_RECIPE)
    assert (child.train.steps, child.train.batch_size, child.components.llm.lr) == (9, 3, 2e-4)
    # every key the chain does not change is the base's, the sections it touches included
    same = dump_toml(plain.model_copy(update={"train": child.train, "components": child.components}))
    assert dump_toml(child) == same and child.components.vision == plain.components.vision
    assert load_config(tmp_path / "parts" / "child.toml", ["--train.steps=2"]).train.steps == 2  # CLI over all


@pytest.mark.parametrize("text, expected", [
    ('base = "nowhere.toml"\n', "base = 'nowhere.toml' does not exist"),
    ('base = "own.toml"\n', "makes a cycle (own.toml -> own.toml)"),
    ("base = 3\n", "base must be the path of another recipe"),
])
def test_a_bad_base_is_one_line(tmp_path, text, expected):
    (tmp_path / "own.toml").write_text(text)
    with pytest.raises(ConfigError, match="^[^\n]*$") as err:
        load_config(tmp_path / "own.toml")
    assert expected in str(err.value)


def test_the_long_recipe_is_the_demo_recipe_plus_its_changes():
    demo, long = (load_config(TINY_RECIPE.parent / f"{n}.toml") for n in ("tiny_metaworld", "tiny_metaworld_long"))
    assert long.train.steps > demo.train.steps and long.train.output_dir != demo.train.output_dir
    assert (long.model, long.components, long.loss, long.eval) == (demo.model, demo.components, demo.loss, demo.eval)


def test_configuration_reference_is_current():
    from vlaforge.config.reference import markdown_reference

    doc = (TINY_RECIPE.parents[1] / "docs" / "configuration.md").read_text()
    assert doc == markdown_reference(), "regenerate: python -m vlaforge.config.reference > docs/configuration.md"
