"""The bindings' torch tensor reader: torch's C++ API (libsymheap_torch.so) where it
was built, and the Python C API fallback (SYMHEAP_TORCH_NATIVE=0) read alike."""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from symheap import _core  # noqa: E402

_PROBE = r"""
import json, torch
from symheap import _core

class Sub(torch.Tensor):
    pass

base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
cases = {
    "f32": base, "transposed": base.t(), "sliced": base[1:3, ::2], "row": base[2],
    "scalar": torch.tensor(3.0), "empty": torch.empty(0, 6),
    "bf16": base.to(torch.bfloat16), "f16": base.to(torch.float16),
    "fp8": base.to(torch.float8_e4m3fn), "i32": base.to(torch.int32),
    "i64": base.to(torch.int64), "f64": base.to(torch.float64), "bool": base > 3,
    "needs_grad": base.clone().requires_grad_(), "parameter": torch.nn.Parameter(base.clone()),
    "subclass": base.as_subclass(Sub), "six_dims": torch.zeros(1, 2, 1, 2, 1, 2)[..., ::2],
    "nine_dims": torch.zeros([1] * 9), "not_a_tensor": [1, 2],
}
out = {"reader": _core.torch_reader()}
for name, t in cases.items():
    for contiguous in (False, True):
        r = _core.torch_tensor_fields(t, contiguous)
        if r is not None:  # the address of a contiguous copy differs from run to run
            ptr, *rest = r
            same = ptr == t.data_ptr()
            r = [same if (t.is_contiguous() or not contiguous) else not same] + rest
        out[f"{name}/{contiguous}"] = r
print(json.dumps(out))
"""


def _probe(native: bool):
    env = dict(os.environ, SYMHEAP_TORCH_NATIVE="1" if native else "0")
    # The symheap this process imported (installed, or the source tree with its build).
    here = os.path.dirname(os.path.dirname(os.path.abspath(_core.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_cpp_reader_is_in_use():
    # CI builds with torch importable, so the C++ reader must be there and fit.
    assert _core.torch_reader().startswith("torch C++ API"), _core.torch_reader()


def test_both_readers_agree():
    cpp, py = _probe(True), _probe(False)
    assert cpp.pop("reader").startswith("torch C++ API")
    assert py.pop("reader") == "Python C API: SYMHEAP_TORCH_NATIVE=0"
    assert cpp == py
    assert cpp["f32/False"] == [True, "float32", [4, 6], [6, 1], -1, True]
    assert cpp["transposed/False"] == [True, "float32", [6, 4], [1, 6], -1, False]
    assert cpp["transposed/True"] == [True, "float32", [6, 4], [4, 1], -1, True]
    assert cpp["fp8/False"][1] == "float8_e4m3fn" and cpp["f64/False"][1] == "float64"
    assert cpp["scalar/False"][2:4] == [[], []] and cpp["empty/False"][2] == [0, 6]
    assert cpp["not_a_tensor/False"] is None
