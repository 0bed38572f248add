"""Make (or verify) the bundle the GPU check needs on a machine without network: `make gpu-bundle`.

The GPU machine brings its own torch and Triton and receives the working tree plus at most
64 MiB of git-ignored files. Everything else the check imports comes from this bundle
(`.gpu_bundle/`, git-ignored):

- `wheels/`: the exact versions installed here of every distribution `benchmarks/gpu_check.py`,
  `contbatch` and `transformers` import beyond torch, triton and numpy (found by importing
  them, not by a hand-kept list), binary ones for CPython 3.11 to 3.13, fetched with
  `pip download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 ...`;
- `requirements.txt`: those pins, which `gpu_check.sh` installs with `--no-index`;
- `models/`: the SmolLM2 config the check compares its architecture with (when cached here);
- `manifest.json`: the project's version at bundle time, the pins and the wheel files.

The project itself travels as the working tree (put on PYTHONPATH by gpu_check.sh). `--verify`
(run first by gpu_check.sh) fails when the manifest is missing, a pinned distribution has no
wheel, or the bundle is over the limit, so an incomplete bundle stops the check before the
machine's time is spent.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20
PYTHONS = ("3.11", "3.12", "3.13")  # transformers 5 needs 3.11 or newer
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux1_x86_64")
# The device image's own: the check must run on its torch/Triton, and numpy comes with them.
IMAGE_OWNS = {"torch", "triton", "numpy", "setuptools", "contbatch", "pip", "wheel"}
ALSO_NEEDED = ("tokenizers", "safetensors")  # imported lazily, while a model is built or loaded


def imported_distributions() -> dict[str, str]:
    """{distribution: installed version} for what importing the check pulls in, minus the image's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    import gpu_check  # noqa: F401
    import gpu_check_models  # noqa: F401
    import gpu_check_runs  # noqa: F401

    owners = md.packages_distributions()
    names = {d for m in list(sys.modules) for d in owners.get(m.split(".")[0], [])} | set(ALSO_NEEDED)
    out = {}
    for name in sorted(names, key=str.lower):
        if name.lower() in IMAGE_OWNS or name.lower().startswith("nvidia"):
            continue
        out[md.metadata(name)["Name"]] = md.version(name)
    return out


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def download(pins: dict[str, str], wheels: Path) -> None:
    """Every pin for every Python in PYTHONS (pure wheels land once); a pin with no wheel fails."""
    specs = [f"{n}=={v}" for n, v in pins.items()]
    for py in PYTHONS:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation",
               "cp", "--python-version", py, "-d", str(wheels)]
        for plat in PLATFORMS:
            cmd += ["--platform", plat]
        for spec in specs:  # one at a time: one package without a wheel for this Python must not hide the rest
            r = subprocess.run(cmd + [spec], capture_output=True, text=True)
            if r.returncode != 0:
                print(f"  no wheel of {spec} for CPython {py}: {r.stderr.strip().splitlines()[-1:]}")


def make(out: Path) -> int:
    pins = imported_distributions()
    if out.exists():
        shutil.rmtree(out)
    (out / "wheels").mkdir(parents=True)
    print(f"gpu-bundle: {len(pins)} distributions: " + ", ".join(f"{n}=={v}" for n, v in pins.items()))
    download(pins, out / "wheels")
    (out / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
    cached = Path(os.environ.get("CONTBATCH_CACHE") or Path.home() / ".cache/contbatch")
    config = cached / "SmolLM2-135M-Instruct" / "config.json"
    if config.is_file():
        (out / "models" / "SmolLM2-135M-Instruct").mkdir(parents=True)
        shutil.copy(config, out / "models" / "SmolLM2-135M-Instruct" / "config.json")
    manifest = {"contbatch": md.version("contbatch"), "pins": pins,
                "pythons": list(PYTHONS), "wheels": sorted(p.name for p in (out / "wheels").iterdir())}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return verify(out)


def verify(out: Path) -> int:
    """0 if the bundle is complete, current and within the limit; else 2 with the reason."""
    manifest = out / "manifest.json"
    if not manifest.is_file():
        print(f"gpu-bundle: {out} is missing or incomplete; make it with: make gpu-bundle")
        return 2
    m = json.loads(manifest.read_text())
    problems = []
    size = folder_bytes(out)
    if size > LIMIT_BYTES:
        problems.append(f"{size / 2**20:.1f} MiB, over the {LIMIT_BYTES // 2**20} MiB a device run can carry")
    names = {p.name.split("-")[0].lower().replace("_", "-") for p in (out / "wheels").glob("*.whl")}
    missing = [n for n in m.get("pins", {}) if n.lower().replace("_", "-") not in names]
    if missing:
        problems.append(f"no wheel at all for: {', '.join(missing)}")
    if problems:
        print(f"gpu-bundle {out}: " + "; ".join(problems) + "; remake it with: make gpu-bundle")
        return 2
    print(f"gpu-bundle {out}: ok, {size / 2**20:.1f} MiB, {len(m['pins'])} pins, {len(m['wheels'])} wheels")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / ".gpu_bundle")
    p.add_argument("--verify", action="store_true", help="only check an existing bundle")
    args = p.parse_args()
    return verify(args.out) if args.verify else make(args.out)


if __name__ == "__main__":
    sys.exit(main())
