"""`bench --parallel`'s measurement (fastremover.parallel.bench) and `info`'s parallel lines, on CPU processes."""

import pytest
import torch

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
    rec = bench_denoise(2, preset="tiny", mode="eager", latent_shape=(1, 16, 1, 4, 8), steps=1, repeats=1,
                        device="cpu", timeout_s=120, threads=1)
    assert rec["world_size"] == 2 and rec["sp_transport"] == "fp16" and rec["parallel"] == "ulysses"
    assert rec["max_rel_diff"] == 0.0
    assert rec["reference_s"] > 0 and rec["parallel_s"] > 0 and rec["collective_host_s"] > 0
    assert rec["exposed_comm_s"] is None


def test_info_lists_gpus_and_nccl():
    info = parallel_info()
    assert len(info["gpus"]) == torch.cuda.device_count() and info["gloo"]
    lines = info_lines()
    assert lines[0].startswith("GPUs: ") and lines[1].startswith("NCCL: ")
