"""Rebuild the parts that carry vLLM 0.26.0 to the GPU machine (bench/vllm_gpu.sh installs them there).

The GPU machine has no network and takes at most 64 MiB per call (repo files included), so the wheels in
bench/vllm_wheels.txt travel as folders p00 ... p05 of at most 60 MiB each, one per back-to-back call,
and are copied flat into one folder (/tmp/vllm_carry) on the machine. The vllm wheel alone is too big for
one call even after its large ELF members are LZMA-compressed, so it goes as 4 chunks over p00-p03;
p05 carries install.sh, which joins the chunks, checks the wheel's sha256 and installs every wheel
into $SITE.

    python bench/vllm_carry.py [OUT]      # OUT defaults to .vcarry in the repo root

Downloads land in OUT/cache and are reused on the next run.
"""

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LISTING = REPO / "bench" / "vllm_wheels.txt"
VLLM_WHEEL = "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
N_CHUNKS = 4
PARTS = [f"p{i:02d}" for i in range(6)]
PART_LIMIT = 60 << 20  # leaves 4 MiB of the 64 MiB per call for the repo's own files
LZMA_MIN = 1 << 20
# Every manylinux tag the listed wheels carry.
PLATFORMS = [
    "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_5_x86_64",
    "manylinux_2_26_x86_64",
]


@dataclass
class Wheel:
    filename: str
    size: int
    part: str


def read_listing(path: Path) -> tuple[list[Wheel], int]:
    """The small wheels of the listing, and the listed size of the recompressed vllm wheel."""
    wheels, vllm_size = [], None
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        if fields[0] == VLLM_WHEEL:
            # Its line carries a note in parentheses between the name and the size.
            vllm_size = int(fields[-2])
        else:
            wheels.append(Wheel(fields[0], int(fields[1]), fields[2]))
    if vllm_size is None:
        raise SystemExit(f"{path}: no line for {VLLM_WHEEL}")
    return wheels, vllm_size


def download(filename: str, cache: Path) -> Path:
    """Fetch one wheel into cache unless it is there, and insist pip chose exactly that file."""
    path = cache / filename
    if not path.exists():
        name, version, *_, platform_tag = filename[:-len(".whl")].split("-")
        # pip prefers the platforms in the order given; where a release has wheels for both old and new
        # manylinux (apache_tvm_ffi 0.1.10 does), only the listed file's own tags first make it pick that one.
        own = [] if platform_tag == "any" else platform_tag.split(".")
        platforms = [arg for p in dict.fromkeys([*own, *PLATFORMS]) for arg in ("--platform", p)]
        # The machine-wide constraints pin torch for this machine; they mean nothing for the GPU machine's
        # wheels and can only make a download fail.
        env = {**os.environ, "PIP_CONSTRAINT": ""}
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(cache),
               f"{name}=={version}"]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=env)
        if not path.exists():
            got = sorted(p.name for p in cache.glob(f"{name}-{version}-*.whl"))
            raise SystemExit(f"{filename}: pip downloaded {got or 'nothing'} instead")
    return path


def recompress(src: Path, dst: Path) -> None:
    """Store ELF members of 1 MiB or more with LZMA (zip method 14, which pip reads); the rest deflated.

    Every member's bytes stay as they are, so the wheel's own RECORD stays valid and is copied as is.
    """
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as out:
        for info in zin.infolist():
            data = zin.read(info)
            zi = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            zi.external_attr, zi.create_system = info.external_attr, info.create_system
            if data[:4] == b"\x7fELF" and len(data) >= LZMA_MIN:
                zi.compress_type = zipfile.ZIP_LZMA
                out.writestr(zi, data)
            else:
                zi.compress_type = zipfile.ZIP_DEFLATED
                out.writestr(zi, data, compresslevel=9)
    with zipfile.ZipFile(dst) as z:
        bad = z.testzip()
    if bad is not None:
        raise SystemExit(f"{dst}: member {bad} fails its CRC check")


def split(path: Path, n: int) -> list[Path]:
    """Cut a file into n chunks of nearly equal size: path.part0 ... path.part{n-1}."""
    data = path.read_bytes()
    step = -(-len(data) // n)
    chunks = []
    for k in range(n):
        chunk = path.with_name(f"{path.name}.part{k}")
        chunk.write_bytes(data[k * step:(k + 1) * step])
        chunks.append(chunk)
    return chunks


def check_sizes(sizes: dict[str, int], part_of: dict[str, str]) -> None:
    """Every part within PART_LIMIT: the listing says which part each wheel travels in."""
    for part in PARTS:
        total = sum(sizes[f] for f, p in part_of.items() if p == part)
        if total > PART_LIMIT:
            raise SystemExit(f"{part}: {total} bytes, over {PART_LIMIT}: move a wheel of it to another part in "
                             f"{LISTING.name}")


def install_script(chunks: list[str], sha_file: str, expected: list[str]) -> str:
    """install.sh for the GPU machine, run once every part's files lie flat in $CARRY_DIR."""
    listed = " \\\n  ".join(expected)
    return f"""#!/usr/bin/env bash
# Written by bench/vllm_carry.py. Joins the vllm wheel's chunks, checks it, installs every wheel here
# into $SITE and imports vllm from there.
set -euo pipefail
CARRY_DIR=${{CARRY_DIR:-/tmp/vllm_carry}}
SITE=${{SITE:-/tmp/site}}
cd "$CARRY_DIR"
# A part that never arrived would otherwise show up only as an import error much later.
missing=0
for f in \\
  {listed}; do
  [ -f "$f" ] || {{ echo "missing: $f (was every part copied into $CARRY_DIR?)"; missing=1; }}
done
[ "$missing" = 0 ]
echo "joining {len(chunks)} chunks into {VLLM_WHEEL}"
cat {" ".join(chunks)} > {VLLM_WHEEL}
echo "checking its sha256"
sha256sum -c {sha_file}
echo "installing $(ls ./*.whl | wc -l) wheels into $SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" ./*.whl
echo "import check: from vllm import LLM"
PYTHONPATH="$SITE" python3 -c "from vllm import LLM"
echo "vllm is installed in $SITE"
"""


def exclude_from_git() -> None:
    """Keep .vcarry (some 300 MB of wheels) out of git, and so out of every device call's repo copy."""
    exclude = REPO / ".git" / "info" / "exclude"
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    if "/.vcarry/" not in lines:
        with exclude.open("a") as f:
            f.write("/.vcarry/\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, default=REPO / ".vcarry")
    out = ap.parse_args().out.resolve()
    cache = out / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    exclude_from_git()

    wheels, listed_vllm_size = read_listing(LISTING)
    mismatched = []
    for w in wheels:
        size = download(w.filename, cache).stat().st_size
        if size != w.size:
            mismatched.append(f"{w.filename}: {size} bytes, listed {w.size}")
    if mismatched:
        raise SystemExit("wheels differ from the listing:\n  " + "\n  ".join(mismatched))
    vllm_src = download(VLLM_WHEEL, cache)

    build = out / "build"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir()
    vllm = build / VLLM_WHEEL
    print(f"recompressing {VLLM_WHEEL} ({vllm_src.stat().st_size} bytes)", flush=True)
    recompress(vllm_src, vllm)
    vllm_size = vllm.stat().st_size
    print(f"recompressed: {vllm_size} bytes (listing: {listed_vllm_size}, {vllm_size - listed_vllm_size:+d})")
    sha_file = build / f"{VLLM_WHEEL}.sha256"
    sha_file.write_text(f"{hashlib.sha256(vllm.read_bytes()).hexdigest()}  {VLLM_WHEEL}\n")
    chunks = split(vllm, N_CHUNKS)

    carried = {c.name: PARTS[k] for k, c in enumerate(chunks)} | {sha_file.name: PARTS[-1]}
    part_of = {w.filename: w.part for w in wheels} | carried
    script = install_script([c.name for c in chunks], sha_file.name, list(part_of))
    sizes = {w.filename: w.size for w in wheels} | {f: (build / f).stat().st_size for f in carried}
    sizes["install.sh"] = len(script.encode())
    part_of["install.sh"] = PARTS[-1]
    check_sizes(sizes, part_of)

    for part in PARTS:
        shutil.rmtree(out / part, ignore_errors=True)
        (out / part).mkdir()
    for filename, part in part_of.items():
        if filename in carried:
            (build / filename).replace(out / part / filename)
        elif filename != "install.sh":
            shutil.copyfile(cache / filename, out / part / filename)
    (out / PARTS[-1] / "install.sh").write_text(script)
    shutil.rmtree(build)

    print(f"\n{'part':<6}{'files':>6}{'bytes':>12}{'MiB':>8}")
    grand = 0
    for part in PARTS:
        files = list((out / part).iterdir())
        size = sum(f.stat().st_size for f in files)
        grand += size
        print(f"{part:<6}{len(files):>6}{size:>12}{size / 2**20:>8.2f}")
    print(f"{'total':<6}{'':>6}{grand:>12}{grand / 2**20:>8.2f}")


if __name__ == "__main__":
    main()
