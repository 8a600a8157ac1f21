"""Every EP kernel is loaded when an op is made (kernels::for_each_kernel in
src/ops/ep/ep_kernels.cuh): with CUDA's lazy module loading, a kernel's first
launch may wait for every kernel running on the device, so a kernel missing
from that list could, on its first launch, wait behind a kernel that spins
until a peer's bytes land. Checked on the sources, so it runs without a GPU."""
import pathlib
import re

EP = pathlib.Path(__file__).resolve().parents[2] / "src" / "ops" / "ep"


def _listed():
    text = (EP / "ep_kernels.cuh").read_text()
    body = re.search(r"void for_each_kernel\(F&& f\) \{(.*?)\n\}", text, re.S)
    assert body, "kernels::for_each_kernel not found in ep_kernels.cuh"
    return set(re.findall(r"f\((\w+(?:<\w+>)?)\);", body.group(1)))


def _defined_and_launched():
    kernels = set()
    for path in EP.glob("*.cuh"):
        text = path.read_text()
        kernels |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\(",
                                  text))
        # template kernels: each instantiation a launcher uses
        kernels |= set(re.findall(r"launch(?:_early)?\((\w+<\w+>),", text))
    return kernels


def test_every_ep_kernel_is_loaded_when_an_op_is_made():
    defined = _defined_and_launched()
    templates = {k.split("<")[0] for k in defined if "<" in k}
    needed = {k for k in defined if k not in templates}
    listed = _listed()
    assert len(needed) >= 12, sorted(needed)  # the parse found the kernels
    missing = needed - listed
    assert not missing, f"kernels::for_each_kernel misses {sorted(missing)}"
    assert listed <= needed, f"for_each_kernel names unknown kernels {sorted(listed - needed)}"
