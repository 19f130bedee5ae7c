"""A CPU float32 model is loaded with every compiled op it will call already compiled or loaded.

numba compiles a kernel once per array layout (contiguous 'C', strided 'A') on its first call;
on a fresh machine that was ~4 s of JIT inside the first engine step (bench_engine (a)'s first
run: 11.4 s against 7.5 s once cached). `load_model` now warms each op for each layout the
decoder passes (`operators/model/ops.warm_up_cpu`, and the delta-rule and attention kernels'
own warm-ups), so a generate over images, a video and text, at batch 1 and batch > 1, adds no
signature. Run in a fresh interpreter: in this one, earlier tests have compiled them already.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import torch
torch.set_num_threads(1)
from test_engine_support import image, request, video
from vlbatch.operators.factory import load_engine
from vlbatch.operators.kernels.attention import cpu_decode as attn
from vlbatch.operators.kernels.delta_rule import cpu_scan
from vlbatch.operators.model.ops import conv_cpu, heads_cpu, norm_cpu, pixels_cpu, rope_cpu

KERNELS = {"conv step": conv_cpu._step_kernel, "conv packed": conv_cpu._packed_kernel, "conv slots": conv_cpu._slots_kernel,
           "heads": heads_cpu._heads_kernel, "rms norm": norm_cpu._rms_kernel, "norm rope": rope_cpu._norm_rope_kernel,
           "delta scan and decode": cpu_scan.scan_kernel, "paged attention": attn._kernel, "pixels": pixels_cpu.patches_kernel}

def sigs():
    return {name: sorted(map(str, k.signatures)) for name, k in KERNELS.items()}

ckpt = sys.argv[1]
engine = load_engine(ckpt, device="cpu", dtype="float32")
at_load = sigs()
alone = [request(ckpt, "one", [("image", image(0)), "Describe."], max_new_tokens=3)]
batch = [request(ckpt, f"r{i}", c, max_new_tokens=4) for i, c in enumerate([
    [("image", image(1, 40, 56)), "Describe."], [("image", image(1, 40, 56)), "What colour?"],
    [("video", video(2)), "What happens?"], ["Write a short caption " + "word " * 20]])]
for reqs in (alone, batch):
    list(engine.generate(reqs))
print(json.dumps({"at_load": at_load, "after": sigs()}))
"""


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_generate_after_load_compiles_nothing(tiny_ckpt):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_ckpt("dense")), str(TESTS)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    missing = {name: sorted(set(after) - set(res["at_load"][name])) for name, after in res["after"].items()}
    assert not any(missing.values()), f"compiled during generate, not at load: {missing}"
    assert all(res["at_load"].values()), f"not loaded at load: {res['at_load']}"
