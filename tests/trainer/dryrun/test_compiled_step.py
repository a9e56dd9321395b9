"""The compiled GPU step counted on the CPU: `python -m mlperf_bert.dryrun.compiled`.

Inductor generates the shipped H200 config's CUDA step on the fake device (Triton's code for
compute capability 9.0, nothing launched); the command fails on any graph break, and a Python
import planted in a layer's forward is caught as one. The wrapper-module reader (`kernels.py`) is
checked on a module written in Inductor's form.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlperf_bert.dryrun import kernels
from tests.harness.paths import REPO

SHIPPED = REPO / "config_DGXH200_1x8.sh"
# A layer's forward with an import in it, as a kernel choice made per call would do (runtime/optional.py).
PLANTED = """
import importlib, sys
from mlperf_bert.dryrun.native import load
load()
from mlperf_bert.model import bert
forward = bert.BertLayer.forward
def planted(self, *args):
    importlib.import_module("json")
    return forward(self, *args)
bert.BertLayer.forward = planted
from mlperf_bert.dryrun.compiled import main
sys.exit(main(sys.argv[1:]))
"""


def _compiled(*args: str, script: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", script, *args] if script else [sys.executable, "-m", "mlperf_bert.dryrun.compiled",
                                                                     *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)


@pytest.fixture(scope="module")
def shipped_step(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("compiled") / "reports" / "h200.json"  # a folder that is not there yet
    done = _compiled(str(SHIPPED), "--layers", "1", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "graph breaks: 0" in done.stdout
    assert "context_fn is passed" not in done.stdout + done.stderr  # torch's note on bert.add_and_norm's region
    return json.loads(out.read_text())


def test_shipped_h200_step_compiles_to_one_graph_per_layer(shipped_step: dict) -> None:
    step = shipped_step["step"]
    assert (shipped_step["gpu"], shipped_step["precision"], shipped_step["attention"]) == ("H200", "bf16", "varlen")
    assert shipped_step["graph_breaks"] == []
    # one encoder layer and the MLM transform: one Dynamo graph each, forward and backward modules
    assert step["dynamo_graphs"] == 2 and step["inductor_modules"] == 4
    # the layer's attention is the varlen custom op, forward and backward, kept whole by Inductor
    assert step["extern"]["attention"] == 2
    # 4 linears of the layer (QKV fused) and the MLM transform's: forward, input and weight gradients
    assert step["extern"]["gemm"] == 3 * 5
    assert step["elementwise_launches"] > 10 and step["elementwise_bytes"] > 1e9
    largest = step["largest"]
    assert largest == sorted(largest, key=lambda k: k["bytes"] * k["launches"], reverse=True)
    assert any("gelu" in k["name"] for k in largest)
    # each LayerNorm's backward is one kernel over its rows (`bert.add_and_norm` keeps the first one's input): no
    # pointwise kernel recomputes a normalised input for a second one
    assert not [k["name"] for k in largest if k["kind"] == "pointwise" and "native_layer_norm" in k["name"]]


def test_a_python_import_in_a_layer_forward_is_a_graph_break_and_fails(tmp_path: Path) -> None:
    done = _compiled(str(SHIPPED), "--layers", "1", "--json", str(tmp_path / "r.json"), script=PLANTED)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "graph break" in done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["graph_breaks"] and "import_module" in report["graph_breaks"][0]["reason"]


def test_bad_arguments_are_refused_before_any_work(tmp_path: Path) -> None:
    done = _compiled(str(tmp_path / "config_NONE_1x8.sh"), "--gpu", "H300")
    assert done.returncode == 2
    assert "no such config file" in done.stderr and "--gpu H300" in done.stderr


WRAPPER = '''
triton_poi_fused_gelu_0 = async_compile.triton('triton_poi_fused_gelu_0', \'\'\'
@triton_heuristics.pointwise(
    size_hints={'x': 1024},
    inductor_meta={'kernel_name': 'triton_poi_fused_gelu_0', 'kernel_num_gb': 0.25, 'num_load': 1},
)
@triton.jit
def triton_poi_fused_gelu_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    pass

def call(args):
    triton_poi_fused_gelu_0.run(*args, stream=0)
\'\'\', device_str='cuda')

triton_red_fused_sum_1 = async_compile.triton('triton_red_fused_sum_1', \'\'\'
@triton_heuristics.reduction(
    inductor_meta={'kernel_name': 'triton_red_fused_sum_1', 'num_load': 1},
)
@triton.jit
def triton_red_fused_sum_1(in_ptr0, out_ptr0, xnumel, r0_numel):
    pass
\'\'\', device_str='cuda')

class Runner:
    def call(self, args):
        primals_1, primals_2 = args
        with torch.cuda._DeviceGuard(0):
            extern_kernels.addmm(primals_2, primals_1, primals_1, alpha=1, beta=1, out=buf0)
            triton_poi_fused_gelu_0.run(buf0, buf1, 100, stream=raw_stream0)
            buf2 = torch.ops.mlperf_bert.varlen_flash_forward.default(buf1, buf1, buf1, cu, 512, 0.1)
            triton_poi_fused_gelu_0.run(buf1, buf3, 100, stream=raw_stream0)
            aten.randint.low_out(-1, 1, [1], out=buf8)
            triton_red_fused_sum_1.run(buf3, buf4, 100, 10, stream=raw_stream0)
            assert_size_stride(buf2, (1, ), (1, ), 'torch.ops.mlperf_bert.varlen_flash_forward.default')
        return (buf4, )

runner = Runner(partitions=[])
call = runner.call
'''


def test_launches_are_read_from_the_wrapper_call_in_order() -> None:
    found = kernels.launches(WRAPPER)
    assert [(k.name, k.kind, k.bytes, k.extern) for k in found] == [
        ("addmm", kernels.EXTERN, None, kernels.GEMM),
        ("triton_poi_fused_gelu_0", kernels.POINTWISE, 250_000_000, None),
        ("mlperf_bert.varlen_flash_forward", kernels.EXTERN, None, kernels.ATTENTION),
        ("triton_poi_fused_gelu_0", kernels.POINTWISE, 250_000_000, None),
        ("aten.randint", kernels.EXTERN, None, kernels.FALLBACK),
        ("triton_red_fused_sum_1", kernels.REDUCTION, None, None),
    ]
    assert sum(k.elementwise for k in found) == 3


def test_a_module_without_a_call_is_refused() -> None:
    with pytest.raises(ValueError, match="not an Inductor wrapper module"):
        kernels.launches("x = 1\n")


def test_the_fp8_delayed_layer_makes_each_fp8_operand_in_one_pass(tmp_path: Path) -> None:
    """The H200 config with the delayed FP8 recipe, one layer: every FP8 operand comes from a single-pass op and
    none from Inductor's kernels (no one-byte transposed stores): 3 inputs and 4 weights cast with their
    transposed copies, FC2's input from GELU, FC2's output gradient from the last LayerNorm's backward, the other
    three layers' output gradients (QKV's, the output projection's, FC1's through GELU's derivative) in passes
    of their own."""
    out = tmp_path / "fp8.json"
    done = _compiled(str(SHIPPED), "--layers", "1", "--config_var", "PRECISION=fp8", "--config_var",
                     "FP8_RECIPE=delayed", "--top", "100", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    largest = json.loads(out.read_text())["step"]["largest"]
    ops: dict[str, int] = {}
    for k in largest:
        if k["kind"] == "fused op":
            ops[k["name"]] = ops.get(k["name"], 0) + k["launches"]
    assert ops == {"mlperf_bert.fp8_cast_transpose": 3, "mlperf_bert.fp8_weight_cast_transpose": 4,
                   "mlperf_bert.fp8_gelu_cast_transpose": 1, "mlperf_bert.fp8_norm_grad_cast_transpose": 1,
                   "mlperf_bert.fp8_grad_cast_transpose": 3}, ops
    # no weight's amax reduced apart, no FP8 copy transposed by Inductor (what the casts were before the ops)
    assert not [k["name"] for k in largest if k["bytes"] > 1e6 and ("amax" in k["name"] or "clone" in k["name"])]
