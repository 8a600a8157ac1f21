"""Which kernels a change touches, without a GPU: compiles one CUDA source at two
git revisions for sm_90a and compares, kernel by kernel, ptxas's registers and
spill bytes and the SASS (nvdisasm; branch labels, addresses and constants
normalised). Kernels are matched by their demangled names with trailing
`false` template arguments dropped, so a kernel that gained a flag defaulting
to false still meets its old self.

    python bench/sass_diff.py OLD NEW src/ops/attention/attention_cuda_hopper_fwd_bf16.cu
        [--cute DIR] [--nvdisasm PATH] [--all]

OLD and NEW are revisions (`main`, `HEAD~1`) or `.` for the working tree.
CuTe's headers come from the nvidia-cutlass wheel (found through pip) unless
--cute names them; nvdisasm from PATH, the CUDA toolkit or the
nvidia-cuda-nvdisasm wheel. Prints one line per kernel that differs (and with
--all every kernel), then a count of those unchanged.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

FLAGS = ["-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
         "-DSYMHEAP_WITH_CUDA=1", "-DSYMHEAP_WITH_HOPPER_ATTN=1", "-Xptxas", "-v"]


def find_cute(given):
    if given:
        return given
    try:
        import cutlass_library  # noqa: F401 - the nvidia-cutlass wheel
        root = os.path.dirname(cutlass_library.__file__)
        path = os.path.join(root, "source", "include")
        if os.path.isdir(path):
            return path
    except ImportError:
        pass
    sys.exit("sass_diff: CuTe headers not found; pip install nvidia-cutlass==4.2.0.0 or pass --cute DIR")


def find_nvdisasm(given):
    wheel = [os.path.join(p, "nvidia", sub, "bin", "nvdisasm") for p in sys.path
             for sub in ("cu13", "cuda_nvdisasm")]  # the nvidia-cuda-nvdisasm wheel
    for cand in [given, shutil.which("nvdisasm"), "/usr/local/cuda/bin/nvdisasm", *wheel]:
        if cand and os.path.exists(cand):
            return cand
    sys.exit("sass_diff: nvdisasm not found; pass --nvdisasm PATH (or pip install nvidia-cuda-nvdisasm)")


def tree_of(rev, workdir):
    """A directory holding the repository at `rev` (`.`: the working tree)."""
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                         check=True).stdout.strip()
    if rev == ".":
        return top
    out = os.path.join(workdir, re.sub(r"\W", "_", rev))
    os.makedirs(out)
    archive = subprocess.run(["git", "-C", top, "archive", rev, "include", "src"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    return out


def compile_and_read(tree, source, cute, nvdisasm, workdir, tag):
    cubin = os.path.join(workdir, tag + ".cubin")
    cmd = ["nvcc", *FLAGS, "-I" + os.path.join(tree, "include"), "-I" + os.path.join(tree, "src"),
           "-I" + cute, "-cubin", os.path.join(tree, source), "-o", cubin]
    print(f"[sass_diff] compiling {source} ({tag})", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"sass_diff: nvcc failed for {tag}:\n{done.stderr[-3000:]}")
    resources = {}
    name = None
    for line in done.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and name:
            resources.setdefault(name, {})["spill"] = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            resources.setdefault(name, {})["regs"] = int(m.group(1))
    sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    code, cur = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*\.text\.(\S+):", line)
        if m:
            cur = m.group(1)
            code[cur] = []
            continue
        if cur and re.search(r"/\*[0-9a-f]{4,}\*/", line):
            ins = re.sub(r"/\*[0-9a-f]+\*/", "", line).split(";")[0].strip()
            ins = re.sub(r"\.L_x_\d+", "L", ins)
            ins = re.sub(r"0x[0-9a-f]+", "X", ins)
            ins = re.sub(r"`\(\S+\)", "`(self)", ins)  # a kernel's own name (its RET target)
            code[cur].append(re.sub(r"\s+", " ", ins))
    return resources, code


def demangled(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return dict(zip(names, out))


def key(demangled_name):
    """The name with trailing `false` template arguments dropped."""
    name = re.sub(r"symheap::attention::cuda::", "", demangled_name)
    while True:
        shorter = re.sub(r", ?false>\(", ">(", name, count=1)
        if shorter == name:
            return name
        name = shorter


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("source")
    ap.add_argument("--cute")
    ap.add_argument("--nvdisasm")
    ap.add_argument("--all", action="store_true", help="print every kernel, changed or not")
    a = ap.parse_args()
    cute, nvdisasm = find_cute(a.cute), find_nvdisasm(a.nvdisasm)
    with tempfile.TemporaryDirectory() as work:
        sides = []
        for tag, rev in (("old", a.old), ("new", a.new)):
            res, code = compile_and_read(tree_of(rev, work), a.source, cute, nvdisasm, work, tag)
            names = demangled(sorted(set(res) | set(code)))
            sides.append({key(names[n]): (res.get(n, {}), code.get(n)) for n in names})
    old, new = sides
    same = 0
    for k in sorted(set(old) | set(new)):
        (r0, c0), (r1, c1) = old.get(k, ({}, None)), new.get(k, ({}, None))
        if c0 is not None and c0 == c1 and r0 == r1 and not a.all:
            same += 1
            continue
        what = ("only old" if c1 is None else "only new" if c0 is None
                else "SASS same" if c0 == c1 else f"SASS {len(c0)} -> {len(c1)} instructions")
        spill = f"spill {r0.get('spill', '-')} -> {r1.get('spill', '-')}, regs {r0.get('regs', '-')} -> " \
                f"{r1.get('regs', '-')}"
        print(f"{what:>30} | {spill:>30} | {k[:160]}")
    print(f"[sass_diff] {same} kernels unchanged (SASS and resources)")


if __name__ == "__main__":
    main()
