"""Check the wheels in .whl/ (scripts/gpu_wheels.sh) against the GPU machine they are carried to.

    python scripts/check_wheels.py [.whl]

Fails (exit 1) when a wheel cannot install on CPython 3.12 manylinux x86_64, a package comes twice, a wheel's
Requires-Python excludes 3.12.3, or a wheel's non-extra requirement is met neither by a carried wheel nor by the
GPU machine's packages (its documented list below). A requirement on a GPU package whose version is not documented
is printed as unverified, not failed; so is any pyproject.toml dependency that the resulting set does not meet.
"""

from __future__ import annotations

import email.parser
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging import tags
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

# The GPU machine's Python packages (its documentation): version where documented, None where not.
GPU_KNOWN = {
    "torch": "2.11.0", "accelerate": "1.15.0", "transformers": "5.17.0", "tokenizers": "0.23.2",
    "huggingface-hub": "1.33.0", "safetensors": "0.8.0", "numpy": "2.5.2", "triton": "3.6.0",
}
GPU_UNKNOWN = """aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer click cloudpickle filelock
frozenlist fsspec h11 hf-xet httpcore httpx idna jinja2 markdown-it-py markupsafe mdurl msgpack multidict networkx
ninja packaging pandas peft pillow pip pluggy propcache protobuf psutil py-cpuinfo pyarrow pygments pytest
pytest-timeout python-dateutil pyyaml regex requests rich sentencepiece setuptools shellingham six sympy mpmath
tensorboard tqdm typer typing-extensions urllib3 wheel xxhash yarl zipp tabulate""".split()
# Lower bounds that its transformers 5.17.0 and huggingface_hub 1.33.0 declare: a consistent install there meets them.
GPU_FLOOR = {
    "regex": "2025.10.22", "packaging": "20.9", "pyyaml": "5.1", "tqdm": "4.60", "filelock": "3.10.0",
    "fsspec": "2023.5.0", "click": "8.4.2", "hf-xet": "1.6.0", "httpx": "0.23.0", "typing-extensions": "4.1.0",
}
GPU = {canonicalize_name(n): v for n, v in GPU_KNOWN.items()} | {canonicalize_name(n): None for n in GPU_UNKNOWN}

PYTHON = "3.12.3"
MARKER_ENV = {
    "python_version": "3.12", "python_full_version": PYTHON, "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "implementation_version": PYTHON, "sys_platform": "linux",
    "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "extra": "",
}
# gpu_wheels.sh asks pip for manylinux_2_28 at most: accept those tags and older ones.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(28, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
SUPPORTED = set(tags.cpython_tags((3, 12), abis=["cp312"], platforms=PLATFORMS)) | set(
    tags.compatible_tags((3, 12), interpreter="cp312", platforms=PLATFORMS))


def metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(z.read(name).decode())


def main(folder: str = ".whl") -> int:
    errors, notes = [], []
    carried: dict[str, Version] = {}
    metas = {}
    for wheel in sorted(Path(folder).glob("*.whl")):
        name, version, _, wheel_tags = parse_wheel_filename(wheel.name)
        if not wheel_tags & SUPPORTED:
            errors.append(f"{wheel.name}: no tag installable on cp312 manylinux x86_64")
        if name in carried:
            errors.append(f"{name}: carried twice ({carried[name]} and {version})")
        carried[name] = version
        meta = metas[name] = metadata(wheel)
        if (rp := meta.get("Requires-Python")) and not SpecifierSet(rp).contains(PYTHON):
            errors.append(f"{wheel.name}: Requires-Python {rp} excludes {PYTHON}")
    if not carried:
        errors.append(f"no wheel in {folder}")

    def check(req: Requirement, who: str, failures: list[str]) -> None:
        if req.marker is not None and not req.marker.evaluate(MARKER_ENV):
            return
        name = canonicalize_name(req.name)
        if name in carried:
            have, where = carried[name], "carried"
        elif name in GPU:
            have, where = GPU[name], "GPU machine"
            if have is None:
                floor = GPU_FLOOR.get(name)
                implied = floor and all(s.operator in (">=", ">") for s in req.specifier)
                if req.specifier and not (implied and req.specifier.contains(floor, prereleases=True)):
                    notes.append(f"unverified: {who} needs {req} (GPU machine: version unknown)")
                return
        else:
            failures.append(f"MISSING: {who} needs {req}: neither carried nor on the GPU machine")
            return
        if not req.specifier.contains(have, prereleases=True):
            failures.append(f"CONFLICT: {who} needs {req}, {where} has {have}")

    for name, meta in metas.items():
        for line in meta.get_all("Requires-Dist") or []:
            check(Requirement(line), f"{name} {carried[name]}", errors)
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        check(Requirement(line), "pyproject.toml", notes)

    for name in sorted(carried):
        print(f"  {name}=={carried[name]}" + (f"  (GPU machine has {GPU[name]})" if GPU.get(name) else ""))
    print(f"{len(carried)} packages carried")
    for line in notes:
        print("  " + line)
    for line in errors:
        print("ERROR: " + line, file=sys.stderr)
    print("check_wheels: " + ("FAILED" if errors else "OK"))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
