"""The peak FLOP/s that MFU is judged by: datasheet figures by GPU name (faked here, on a CPU), the
measured fallback, and the source said with the figure."""

import json

import pytest
import torch

import common.peak_flops as peak_flops
import common.runtime as runtime
from common.peak_flops import datasheet_peak, device_peak_flops, measure_matmul_flops


@pytest.mark.parametrize("name, dtype, tf32, expected", [
    ("NVIDIA H200", torch.bfloat16, False, 989e12),
    ("NVIDIA H100 80GB HBM3", torch.float16, False, 989e12),  # the SXM part
    ("NVIDIA H100 80GB HBM3", torch.float32, False, 67e12),  # true fp32: no tensor cores
    ("NVIDIA H100 80GB HBM3", torch.float32, True, 494e12),
    ("NVIDIA H100 PCIe", torch.bfloat16, False, 756e12),  # not the SXM figure
    ("NVIDIA H200 NVL", torch.bfloat16, False, 835e12),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, False, 312e12),
    ("NVIDIA A100 80GB PCIe", torch.float32, False, 19.5e12),
    ("NVIDIA L4", torch.bfloat16, False, 121e12),
    ("NVIDIA L40S", torch.bfloat16, False, 362e12),  # not L4's
    ("NVIDIA A10G", torch.bfloat16, False, None),  # not A100's: unknown, so measured
    ("Tesla T4", torch.float16, False, None),
    ("NVIDIA H100 80GB HBM3", torch.float64, False, None),
])
def test_datasheet_figures_by_device_name(name, dtype, tf32, expected):
    assert datasheet_peak(name, dtype, tf32) == expected


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # measured afresh: nothing cached yet

    def install(name: str):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda device, dtype: 1.5e12)
    return install


def test_a_known_gpu_gets_its_datasheet_figure_and_says_so(fake_gpu):
    fake_gpu("NVIDIA H200")
    assert device_peak_flops(torch.device("cuda", 0), torch.bfloat16) == (989e12, "datasheet: NVIDIA H200, bf16 dense")
    assert device_peak_flops(torch.device("cuda", 0), torch.float32) == (67e12, "datasheet: NVIDIA H200, fp32 dense")


def test_fp32_counts_tf32_only_when_it_is_switched_on(fake_gpu):
    fake_gpu("NVIDIA H100 80GB HBM3")
    assert torch.get_float32_matmul_precision() == "highest"  # PyTorch's default: TF32 off
    assert device_peak_flops(torch.device("cuda"), torch.float32) == (67e12, "datasheet: NVIDIA H100 80GB HBM3, fp32 "
                                                                       "dense")
    try:
        torch.set_float32_matmul_precision("high")
        assert device_peak_flops(torch.device("cuda"), torch.float32) == (494e12, "datasheet: NVIDIA H100 80GB HBM3, "
                                                                           "tf32 dense")
    finally:
        torch.set_float32_matmul_precision("highest")


def test_an_unknown_gpu_is_measured_and_says_so(fake_gpu):
    fake_gpu("NVIDIA A10G")
    flops, source = device_peak_flops(torch.device("cuda"), torch.bfloat16)
    assert flops == 1.5e12 and source == "measured: back-to-back torch.bfloat16 matmuls on NVIDIA A10G"


def test_the_cpu_is_measured(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flops, source = device_peak_flops(torch.device("cpu"), torch.float32)
    assert flops > 0 and source.startswith("measured: back-to-back torch.float32 matmuls on ")
    assert source.endswith(f", {torch.get_num_threads()} threads")  # the CPU's model and the threads it used


def test_measure_keeps_its_signature_and_leaves_the_global_rng_alone():
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    assert measure_matmul_flops(torch.device("cpu"), torch.float32) > 0  # tiny_transformer's call
    assert measure_matmul_flops(torch.device("cpu"), torch.float32, 256) > 0  # the former size argument
    assert torch.equal(torch.rand(2), expected)


def test_a_measured_peak_is_the_best_reading_yet_on_this_machine(monkeypatch, tmp_path):
    """MFU's denominator must not move with how busy the machine was when a run started: the first run takes the
    best of five readings, a later run one more, kept only if higher. A first figure measured under load stayed for
    good, and a quiet run's MFU read 236%."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    readings = iter([1.0e11, 3.0e11, 2.0e11, 2.5e11, 0.5e11])
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda device, dtype: next(readings))
    flops, source = device_peak_flops(torch.device("cpu"), torch.float32)
    assert flops == 3.0e11 and source.startswith("measured: back-to-back torch.float32 matmuls on ")
    calls = []
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda device, dtype: calls.append(dtype) or 2.9e11)
    again, cached = device_peak_flops(torch.device("cpu"), torch.float32)  # a busier machine: the best is kept
    assert calls == [torch.float32] and again == 3.0e11
    assert f"(cached in {tmp_path / 'torch-recipes' / 'peak_flops.json'})" in cached
    assert source in cached and f"{torch.get_num_threads()} threads" in cached
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda device, dtype: 6.0e11)  # a quieter one: replaced
    assert device_peak_flops(torch.device("cpu"), torch.float32) == (6.0e11, source)
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda device, dtype: 1.0e11)
    assert device_peak_flops(torch.device("cpu"), torch.float32)[0] == 6.0e11


def test_a_cpu_with_other_vector_units_under_the_same_name_is_measured_anew(monkeypatch, tmp_path):
    """Cloud CPUs may all be named "AMD EPYC": one with AVX-512 BF16 must not lend its bf16 peak to one without."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda device, dtype: 4.0e11)
    flops, source = device_peak_flops(torch.device("cpu"), torch.bfloat16)
    assert flops == 4.0e11 and "(AVX512; the CPU has avx512_bf16)" in source
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx2"})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(peak_flops, "measure_matmul_flops",
                        lambda device, dtype: {torch.bfloat16: 1.0e9}.get(dtype, 1e11))
    flops, source = device_peak_flops(torch.device("cpu"), torch.bfloat16)
    # bf16 emulated (converted, multiplied in fp32): fp32's peak is its yardstick; its own 1 GFLOP/s gave an MFU of 185%
    assert flops == 1e11 and "torch.float32 matmuls" in source and "(AVX2; no native bf16)" in source
    assert "cached" not in source
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})  # bf16 units, and fp16?
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda device, dtype: {torch.float32: 2e11}.get(dtype, 1e9))
    flops, source = device_peak_flops("cpu", torch.float16)  # a device's name will do
    assert flops == 2e11 and "torch.float32 matmuls" in source  # fp16 is converted there too: 5x MFU against its own
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert device_peak_flops(torch.device("cpu"), torch.bfloat16)[0] == 4.0e11  # each machine's figure kept


def test_an_emulated_dtype_is_measured_in_one_product_and_fewer_readings(monkeypatch, tmp_path):
    """bf16 on a CPU without AVX-512 BF16 runs a 1024^3 product in seconds: that product is the measurement, and
    the peak takes the readings begun within 3 s, not five (a first run waited half a minute before its first step)."""
    products, clock = [], [0.0]  # a fake clock: each product takes 1.1 s of it, however busy the machine is

    def slow_matmul(a, b, out):
        products.append(a.shape)
        clock[0] += 1.1

    monkeypatch.setattr(torch, "matmul", slow_matmul)
    monkeypatch.setattr(peak_flops, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    flops = measure_matmul_flops(torch.device("cpu"), torch.float32, 64)
    assert len(products) == 1 and flops == pytest.approx(2 * 64**3 / 1.1)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    products.clear()
    device_peak_flops(torch.device("cpu"), torch.float32)
    assert len(products) == 3  # readings begun within 3 s: one product each


@pytest.mark.parametrize("damaged", ["[]", '{"KEY": {"flops": "fast"}}', '{"KEY": {"flops": NaN}}', '{"KEY": 7}',
                                     '{"KEY": {"date": "2026-01-01"}}'])
def test_a_damaged_cache_is_measured_over_and_replaced(monkeypatch, tmp_path, damaged):
    """Was an AttributeError traceback (a list), or a string or NaN returned as the peak."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda device, dtype: 2.0e11)
    cache = tmp_path / "torch-recipes" / "peak_flops.json"
    device_peak_flops(torch.device("cpu"), torch.float32)  # the key this machine uses
    (key,) = json.loads(cache.read_text())
    cache.write_text(damaged.replace("KEY", key))
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda device, dtype: 3.0e11)
    flops, source = device_peak_flops(torch.device("cpu"), torch.float32)
    assert flops == 3.0e11 and "cached" not in source
    assert json.loads(cache.read_text())[key]["flops"] == 3.0e11


def test_a_cache_that_cannot_be_written_costs_only_a_measurement_next_time(monkeypatch, tmp_path):
    """write_json says a failed write as a RecipeError, which ended the run before it trained ("could not write
    ~/.cache/torch-recipes/peak_flops.json"): the cache is a convenience, not a file of the run."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    readings = iter([2.0e11] * 5 + [2.5e11] * 5)  # the second call's five readings differ from the first's
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda device, dtype: next(readings))
    (tmp_path / "torch-recipes" / "peak_flops.json").mkdir(parents=True)  # replacing a folder fails, even as root
    assert device_peak_flops(torch.device("cpu"), torch.float32)[0] == 2.0e11
    assert device_peak_flops(torch.device("cpu"), torch.float32)[0] == 2.5e11  # measured again, no error


def test_without_a_home_folder_the_peak_is_measured_and_nothing_is_cached(monkeypatch, tmp_path):
    """HOME unset and a uid with no passwd entry (env -i, docker -u N): Path.home() raised, a traceback before the
    first step, even with XDG_CACHE_HOME set; an empty XDG_CACHE_HOME wrote ./torch-recipes/ into the working
    folder (XDG: an empty or relative value is unset)."""
    import pwd

    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda device, dtype: 2.0e11)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in ("", "relative/cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert device_peak_flops(torch.device("cpu"), torch.float32)[0] == 2.0e11
    assert (tmp_path / "home" / ".cache" / "torch-recipes" / "peak_flops.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]
    monkeypatch.delenv("HOME")
    monkeypatch.delenv("XDG_CACHE_HOME")

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    readings = []
    monkeypatch.setattr(peak_flops, "measure_matmul_flops", lambda device, dtype: readings.append(1) or 3.0e11)
    flops, source = device_peak_flops(torch.device("cpu"), torch.float32)
    assert flops == 3.0e11 and "cached" not in source and len(readings) == 5  # the best of five, every run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # nothing written here ("~" taken as a folder)
