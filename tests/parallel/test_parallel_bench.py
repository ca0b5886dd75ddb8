"""`bench --parallel`'s measurement (fastremover.parallel.bench) and `info`'s parallel lines, on CPU processes."""

import pytest
import torch

from fastremover.config import EngineConfig, ParallelOptions
from fastremover.parallel.bench import bench_denoise, exposed_time, info_lines, latent_shape, parallel_info


def test_exposed_time_counts_only_uncovered_communication():
    # comm [0, 4) and [6, 7); compute [1, 2) and [3, 6.5): exposed = [0,1) + [2,3) + [6.5,7) = 2.5
    assert exposed_time([(0, 4), (6, 7)], [(1, 2), (3, 6.5)]) == pytest.approx(2.5)
    assert exposed_time([(0, 1), (0.5, 2)], []) == pytest.approx(2.0)  # overlapping comm counted once
    assert exposed_time([(1, 2)], [(0, 3)]) == 0.0  # fully hidden
    assert latent_shape(81, 480, 832) == (1, 16, 21, 60, 104)


def test_bench_denoise_records_a_parallel_run_against_the_reference():
    """Tiny preset, eager mode, 2 CPU ranks: the record names the run and the parallel latents equal the reference's
    (fp16 transport: exact; 4 tokens per rank - with 3 or fewer rows the CPU BLAS takes another GEMM kernel, whose
    rows differ in the last bit from the same rows of a larger GEMM). The CPU has no GPU timeline, so exposed_comm_s is None; the host time in the
    collectives is recorded."""
    config = EngineConfig(device="cpu", mode="eager", parallel=ParallelOptions("ulysses", 2, timeout_s=120))
    rec = bench_denoise(config, preset="tiny", latent_shape=(1, 16, 1, 4, 8), steps=1, repeats=1, threads=1)
    assert rec["world_size"] == 2 and rec["sp_transport"] == "fp16" and rec["parallel"] == "ulysses"
    assert rec["max_rel_diff"] == 0.0
    assert rec["reference_s"] > 0 and rec["parallel_s"] > 0 and rec["collective_host_s"] > 0
    assert rec["exposed_comm_s"] is None


def test_info_lists_gpus_and_nccl():
    info = parallel_info()
    assert len(info["gpus"]) == torch.cuda.device_count() and info["gloo"]
    lines = info_lines()
    assert lines[0].startswith("GPUs: ") and lines[1].startswith("NCCL: ")


def test_bench_parallel_command_saves_a_record(tmp_path, capsys):
    """`fastremover bench --parallel 2` on CPU processes: one JSON per mode with the bench's provenance, the world
    size, the transport and the comparison with the one-process loop; the table names them."""
    import json

    from fastremover.cli import main

    rc = main(["bench", "--parallel", "2", "--preset", "tiny", "--modes", "eager", "--device", "cpu", "--steps", "1",
               "--repeats", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    (path,) = tmp_path.glob("w1-parallel2-eager-fp16-*.json")
    rec = json.loads(path.read_text())
    assert rec["world_size"] == 2 and rec["sp_transport"] == "fp16" and rec["workload"] == "w1"
    assert rec["latent_shape"] == list(latent_shape(69, 240, 432)) and rec["max_rel_diff"] == 0.0
    assert rec["commit"] and "command" in rec and rec["gpu"]
    assert "eager        2      fp16" in out


@pytest.mark.parametrize("argv, message", [
    (["--parallel", "3"], "head count divisible by 3"),  # tiny has 2 heads
    (["--parallel", "1"], "at least 2"),
    (["--parallel", "2", "--video", "x.mp4", "--mask", "m.png"], "not with --video"),
])
def test_bench_parallel_bad_flags_are_one_line(argv, message, capsys, tmp_path):
    from fastremover.cli import main

    rc = main(["bench", "--preset", "tiny", "--device", "cpu", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err
