"""`make test`'s check of the installed .venv/lerobot061 (run with the site first on PYTHONPATH): the pinned
versions import from the site, torch / numpy / safetensors from the project's venv (not shadowed), `kernels` is
hidden, torchvision imports, and LeRobot 0.6.1's SmolVLA / pi0 modules and processor pipelines import.

usage: PYTHONPATH=SITE python tests/lerobot_env061/check_site.py SITE NUMPY_VERSION
"""

import importlib
import importlib.util
import sys
from pathlib import Path

site, numpy_version = Path(sys.argv[1]).resolve(), sys.argv[2]
problems = []


def where(module) -> Path:
    return Path(module.__file__).resolve()


for name, version in [("transformers", "5.5.4"), ("huggingface_hub", "1.33.0"), ("tokenizers", "0.22.2"),
                      ("draccus", None), ("torchvision", "0.28.0"), ("cv2", "4.12.0"), ("PIL", "12.3.0")]:
    module = importlib.import_module(name)
    if site not in where(module).parents:
        problems.append(f"{name} comes from {where(module)}, not the site")
    if version and not str(getattr(module, "__version__", "")).startswith(version):
        problems.append(f"{name} {module.__version__} (want {version})")
for name in ("torch", "numpy", "safetensors", "einops", "gymnasium"):
    module = importlib.import_module(name)
    if site in where(module).parents:
        problems.append(f"{name} is shadowed by the site: {where(module)}")
import numpy  # noqa: E402

if numpy.__version__ != numpy_version:
    problems.append(f"numpy {numpy.__version__} under the site, the project has {numpy_version}")
if importlib.util.find_spec("kernels") is not None:
    problems.append("`kernels` is visible (sitecustomize.py did not run?): it breaks transformers 5.5.4")

import lerobot  # noqa: E402
import lerobot.policies.pi0.modeling_pi0  # noqa: E402
import lerobot.policies.smolvla.modeling_smolvla  # noqa: E402
from lerobot.policies.factory import make_pre_post_processors  # noqa: E402, F401
from lerobot.processor import PolicyProcessorPipeline  # noqa: E402, F401

if lerobot.__version__ != "0.6.1":
    problems.append(f"lerobot {lerobot.__version__}")
if problems:
    sys.exit("check_site.py: " + "; ".join(problems))
print(f"check_site.py: lerobot {lerobot.__version__}, transformers 5.5.4, numpy {numpy.__version__} from the "
      "project: ok")
