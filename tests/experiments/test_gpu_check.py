"""experiments/gpu_check.sh --smoke: every step of the GPU check runs its code path on tiny shapes
on the CPU, so the script cannot rot between GPU runs; the run leaves at most 8 files (the
device tool brings back 8), and the summary reports what the steps' JSON files hold."""
import json
import os
import pathlib
import subprocess
import sys
import tarfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_runs_every_step(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    env.pop("GPU_CHECK_STEPS", None)
    run = subprocess.run(["bash", str(ROOT / "experiments" / "gpu_check.sh"), "--smoke"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["results.tgz", "status.tsv", "summary.md"]
    status = [line.split("\t") for line in (out / "status.tsv").read_text().splitlines()[1:]]
    assert [s[0] for s in status] == ["peaks", "kernel_bench", "model", "model_cb", "transformers", "moe",
                                      "moe_mla", "model_70b", "memory"]  # kernel_tests runs on a GPU only
    assert all(s[1] == "0" for s in status), status
    with tarfile.open(out / "results.tgz") as tar:
        names = {pathlib.Path(n).name for n in tar.getnames()}
        peaks = json.load(tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("device_peaks.json"))))
        model = json.load(tar.extractfile(next(m for m in tar.getmembers()
                                               if m.name.endswith("gpu_model_bench.json"))))
    assert {"device_peaks.json", "gpu_model_bench.json", "gpu_model_bench_cb.json",
            "gpu_model_bench_transformers.json", "gpu_model_bench_moe.json", "gpu_model_bench_moe_mla.json",
            "gpu_model_bench_70b.json",
            "memory.json", "step_profile.json", "model.log"} <= names
    summary = (out / "summary.md").read_text()
    assert f"read {peaks['read_gb_s']:,.0f} GB/s" in summary
    assert [r["case"] for r in model["rows"]] == ["decode:2:24:bf16:reference:2", "decode:2:24:fp8_e4m3:no-attention:2",
                                                  "decode:2:24:bf16:no-sampling:2", "decode:2:24:bf16:no-allocator:2",
                                                  "prefill:2:16:bf16:reference:8"]
    assert all("error" not in r for r in model["rows"]), model["rows"]
    for r in model["rows"]:
        assert f"| {r['case']} |" in summary
    for section in ("## Whole model", "## Where a decode step's time goes", "## Kernels", "## The simulator against this run",
                    "## MoE", "## Memory"):
        assert section in summary
    assert "prefill:2:16:bf16:reference:8 (held back)" in summary  # the simulator predicted the run's steps
