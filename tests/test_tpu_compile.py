"""xbridge compile: programs compiled for TPU slices by the real TPU compiler (libtpu's compile-only client) on this
CPU machine. Nothing here ran on a TPU; the figures asserted are the compiler's own (bytes per chip) or arithmetic on
the program's own sizes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from helpers import FIXTURES, PROGRAMS, one_error_line, run_cli
from xbridge.aot import hlo
from xbridge.aot.chips import CHIPS, GIB
from xbridge.aot.record import EVAL, INIT, TRAIN, CompiledProgram, roofline
from xbridge.aot.topology import parse_topology
from xbridge.errors import ConfigError

# ---------------------------------------------------------------------------------------------- names and numbers


@pytest.mark.parametrize("name,jax_name,chips,hosts,config", [
    ("v5e-8", "v5e:2x4", 8, 2, "default"),
    ("v5e-1", "v5e:1x1", 1, 1, "default"),
    ("v5litepod-16", "v5e:4x4", 16, 4, "default"),
    ("v6e-16", "v6e:4x4", 16, 4, "default"),
    ("v5p-128", "v5:4x4x4", 64, 16, "megacore"),     # v5p names count TensorCores, two a chip
    ("v4-8", "v4:2x2x1", 4, 1, "megacore"),
    ("v5e:2x4", "v5e:2x4", 8, 2, "default"),         # JAX's own form, passed through
    ("v5p:2x2x1", "v5:2x2x1", 4, 1, "megacore"),
])
def test_topology_names(name, jax_name, chips, hosts, config):
    topo = parse_topology(name)
    assert (topo.jax_name, topo.chips, topo.hosts, topo.chip_config_name) == (jax_name, chips, hosts, config)


@pytest.mark.parametrize("name,says", [
    ("v5e-3", "v5e names count chips; 3 is not a slice size"),
    ("v5p-7", "v5p names count TensorCores, two a chip"),
    ("v7x-8", "unknown TPU generation 'v7x'"),
    ("v5p:2x2", "a v5p slice's shape has 3 dimensions"),
    ("tpu", "not a TPU slice name"),
])
def test_bad_topology_names(name, says):
    with pytest.raises(ConfigError, match=says):
        parse_topology(name)


TPU_HLO = """
  %all-reduce.1 = f32[256,64]{1,0:T(8,128)} all-reduce(f32[256,64]{1,0} %p), channel_id=1, replica_groups=[1,4]<=[4]
  %all-reduce-start.2 = (bf16[128]{0}, f32[8,8]{1,0}) all-reduce-start(%a, %b), channel_id=2
  %all-reduce-done.2 = (bf16[128]{0}, f32[8,8]{1,0}) all-reduce-done(%all-reduce-start.2)
  %all-gather-start = (bf16[4,32]{1,0:T(8,128)}, bf16[16,32]{1,0:T(8,128)}) all-gather-start(%x), dimensions={0}
  %collective-permute-start.4 = (bf16[4,256,32]{1,2,0:T(8,128)(2,1)S(1)}, bf16[4,256,32]{1,2,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%slice.157), channel_id=14
  ROOT %t = (f32[]) tuple(%c)
  %cc = bf16[2,4,256,64]{3,2,1,0} custom-call(%q, %k, %v), custom_call_target="tpu_custom_call"
"""


def test_collectives_read_from_tpu_hlo():
    assert hlo.collectives(TPU_HLO) == {
        "all-reduce": {"count": 2, "bytes": 256 * 64 * 4 + 128 * 2 + 64 * 4},
        "all-gather": {"count": 1, "bytes": 16 * 32 * 2},                  # the result, not the operand
        "collective-permute": {"count": 1, "bytes": 4 * 256 * 32 * 2},
    }
    assert hlo.custom_calls(TPU_HLO) == 1


def test_out_of_memory_read_from_the_compilers_message():
    used = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used "
            "18.00G of 15.75G hbm. Exceeded hbm capacity by 2.25G.\n\nTotal hbm usage >= 18.26G:")
    assert hlo.out_of_memory(used) == (used.splitlines()[0], 18 * GIB)
    alloc = "RESOURCE_EXHAUSTED: Allocation (size=26843545600) would exceed memory (size=17179869184) :: #a"
    assert hlo.out_of_memory(alloc)[1] == 26843545600
    required = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required "
                "for HLO temporaries (56.01G) exceeds available HBM (15.75G). HLO module: jit_step.")   # libtpu 0.0.50
    assert hlo.out_of_memory(required) == (required, int(56.01 * GIB))
    assert hlo.out_of_memory("INVALID_ARGUMENT: something else") is None


def test_need_fits_and_roofline_arithmetic():
    hbm = CHIPS["v5e"].hbm_bytes
    p = CompiledProgram(TRAIN, 0.1, 1.0, argument_bytes=10 * GIB, output_bytes=10 * GIB, alias_bytes=10 * GIB,
                        temp_bytes=5 * GIB, code_bytes=GIB, flops=197e12 * 0.002, bytes_accessed=819e9 * 0.001)
    assert p.need_bytes == 16 * GIB and p.fits(hbm)              # donated outputs reuse their arguments
    assert not CompiledProgram(TRAIN, 0, 0, refused="RESOURCE_EXHAUSTED: ...", refused_bytes=20 * GIB).fits(hbm)
    topo = parse_topology("v5e-4")
    r = roofline(p, topo, model_flops=int(4 * 197e12 * 0.001), scanned=False)
    assert r.bound_by == "compute" and r.step_s == pytest.approx(0.002)     # 2 ms of FLOPs beats 1 ms of bytes
    assert r.mfu_ceiling == pytest.approx(0.5)                            # model FLOPs are half of XLA's
    scanned = roofline(p, topo, model_flops=int(4 * 197e12 * 0.004), scanned=True)   # the loop body counted once
    assert scanned.step_s == pytest.approx(0.004) and "model FLOPs" in scanned.flops_source


# ---------------------------------------------------------------------------------------------- compiled here


@pytest.fixture(scope="module")
def compile_here():
    """``compile_program`` in this process, with the process setup xbridge compile makes (libtpu quieted, several
    loads allowed); each case compiled once."""
    from xbridge.aot import environment

    saved = dict(os.environ)
    environment.prepare_process()
    from xbridge.aot.compile import compile_program
    from xbridge.program_file import load_program

    done = {}

    def compiled(ref, topology, precision="bf16-mixed", **options):
        key = (ref, topology, precision, tuple(sorted(options.items())))
        if key not in done:
            program = load_program(ref).replace(precision=precision)
            done[key] = compile_program(program, "jax-tpu", parse_topology(topology), options)
        return done[key]

    yield compiled
    os.environ.clear()
    os.environ.update(saved)


def _sane(report):
    hbm = report.topology.chip.hbm_bytes
    assert [p.name for p in report.programs] == [TRAIN, EVAL, INIT]
    for p in report.programs:
        assert p.refused is None and 0 < p.need_bytes < hbm and p.fits(hbm), p
    train = report.programs[0]
    assert train.flops > 0 and train.bytes_accessed > 0 and train.alias_bytes > 0     # the state is donated
    assert report.fits and report.roofline is not None and report.roofline.step_s > 0
    return train


ZOO = str(FIXTURES / "hf_zoo.py")


@pytest.mark.slow
@pytest.mark.parametrize("ref,topology,options", [
    (f"{ZOO}:llama", "v5e-4", {}),
    (f"{ZOO}:moe_sharded", "v6e-4", {}),                     # experts split over an `expert` axis
    (f"{ZOO}:bert", "v6e-4", {}),
    (f"{ZOO}:resnet", "v5e-4", {}),
    (f"{ZOO}:llama_scanned", "v5e-8", {"sharding_mode": "shard_map"}),   # tensor parallel, layers scanned
])
def test_zoo_compiles_for_tpu(compile_here, ref, topology, options):
    report = compile_here(ref, topology, **options)
    train = _sane(report)
    assert report.topology.chip.device_kind in ("TPU v5 lite", "TPU v6 lite")
    assert "all-reduce" in train.collectives        # the batch is split: gradients are summed over the chips


@pytest.mark.slow
def test_per_chip_arguments_are_the_programs_own_sizes(compile_here):
    """The train step's arguments on one chip: the replicated parameters and Adam's two moments in fp32, the step
    counters, and the chip's quarter of the batch; split over a `model` axis, the hidden weights halve."""
    from xbridge.program_file import load_program

    program = load_program(f"{FIXTURES / 'wide_mlp.py'}:program")
    params = sum(int(np.prod(t.shape)) for t in program.model().parameters())
    report = compile_here(f"{FIXTURES / 'wide_mlp.py'}:program", "v5e-4")
    train = _sane(report)
    rows = program.data.batch_size // 4
    batch = rows * 16 * 4 + rows * 4                 # x in float32 (the params dtype), y as int32
    # + the step and Adam's counters, and the TPU's tiles padding the small arrays (an f32[8] bias takes a tile)
    assert train.argument_bytes - (3 * params * 4 + batch) in range(0, 4096)


@pytest.mark.slow
@pytest.mark.cli
def test_done_when_gpt_on_v5e_8_with_flash(tmp_path):
    """The issue's command (bf16-mixed: fp32 matmuls compile as bf16 passes, 5x slower) with the Pallas flash
    kernel, which only compiles for 8 chips wrapped in a shard_map; --dump writes the TPU compiler's HLO."""
    proc = run_cli("compile", str(PROGRAMS / "gpt.py"), "--backend", "jax-tpu", "--topology", "v5e-8",
                   "--attention", "flash", "--precision", "bf16-mixed", "--format", "json", "--dump",
                   str(tmp_path / "dump"))
    assert proc.returncode == 0, proc.stderr
    assert "libtpu" not in proc.stderr and "TPU_WORKER_HOSTNAMES" not in proc.stderr    # quiet
    doc = json.loads(proc.stdout)
    assert doc["topology"]["chips"] == 8 and doc["topology"]["jax_topology"] == "v5e:2x4"
    assert doc["mesh"] == {"data": 8, "model": 1}
    train, evaluation = doc["per_chip"][TRAIN], doc["per_chip"][EVAL]
    assert train["hbm_bytes"] == 16 * GIB and train["fits"] and train["argument_bytes"] > 0
    assert train["flops"] > 0 and train["collectives"]["all-reduce"]["count"] > 0
    assert train["kernels"] == 3 * 4 and evaluation["kernels"] == 4      # 4 layers: fwd, dkv, dq / fwd
    assert doc["roofline"]["estimate"] is True and 0 < doc["roofline"]["mfu_ceiling"] < 1
    text = (tmp_path / "dump" / "train_step.tpu.optimized.hlo.txt").read_text()
    assert text.count('custom_call_target="tpu_custom_call"') == 12 and "T(8,128)" in text   # TPU tiled layouts


@pytest.mark.slow
@pytest.mark.cli
def test_multi_host_slice_compiles_from_one_process():
    proc = run_cli("compile", str(PROGRAMS / "gpt.py"), "--topology", "v5p-128", "--precision", "bf16-mixed",
                   "--batch", "64", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["topology"]["chips"], doc["topology"]["hosts"]) == (64, 16)
    assert doc["per_chip"][TRAIN]["hbm_bytes"] == 96 * GIB and doc["fits"]


@pytest.mark.slow
@pytest.mark.cli
def test_a_program_that_does_not_fit_is_reported_not_refused():
    proc = run_cli("compile", f"{FIXTURES / 'wide_mlp.py'}:huge", "--topology", "v5e-4", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    train = doc["per_chip"][TRAIN]
    assert doc["fits"] is False and train["fits"] is False
    assert "RESOURCE_EXHAUSTED" in train["refused"] and train["need_bytes"] > train["hbm_bytes"] == 16 * GIB
    assert train["margin_bytes"] < 0
    # four 32768-square fp32 layers are 16 GiB: Adam's two moments, made by the initialisation, are 32 GiB (libtpu
    # 0.0.22 compiled it and counted its outputs; 0.0.50 refuses it, saying what its temporaries need)
    assert doc["per_chip"][INIT]["need_bytes"] >= 32 * GIB and not doc["per_chip"][INIT]["fits"]


@pytest.mark.slow
@pytest.mark.cli
def test_fit_finds_the_largest_batch_by_compiling():
    proc = run_cli("compile", f"{FIXTURES / 'wide_mlp.py'}:fitter", "--topology", "v5e-1", "--batch", "131072",
                   "--fit", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    fit = json.loads(proc.stdout)["fit"]
    assert fit["remat"] == "none"
    tried = fit["tried"]
    assert [t["batch"] for t in tried[:2]] == [131072, 262144]       # doubling ...
    assert any(not t["fits"] for t in tried) and all(t["need_bytes"] <= t["hbm_bytes"] for t in tried if t["fits"])
    largest = fit["largest_batch"]
    assert 131072 <= largest < 262144 and all(t["fits"] == (t["batch"] <= largest) for t in tried)  # ... bisection


@pytest.mark.cli
@pytest.mark.parametrize("args,says", [
    (["--topology", "v5e-3"], "--topology 'v5e-3': v5e names count chips"),
    (["--topology", "v5e-8", "--backend", "eager-cpu"], "target eager-cpu cannot be compiled ahead of time"),
    (["--topology", "v5p-128"], "is not divisible by mesh axis 'data' of size 64"),   # GPT's batch of 16
])
def test_bad_input_is_one_line(args, says):
    proc = run_cli("compile", str(PROGRAMS / "gpt.py"), *args)
    assert proc.returncode == 2, proc.stderr
    assert says in one_error_line(proc)


@pytest.mark.cli
def test_backends_says_jax_tpu_can_compile_here():
    proc = run_cli("backends", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    row = next(r for r in json.loads(proc.stdout) if r["target"] == "jax-tpu")
    assert not row["available"] and "no TPU chip" in row["reason"] and "can compile" in row["reason"]


@pytest.mark.slow
@pytest.mark.cli
def test_compare_gives_the_tpu_target_a_compile_only_row(tmp_path):
    out = tmp_path / "cmp"
    proc = run_cli("compare", str(PROGRAMS / "mlp.py"), "--backends", "eager-cpu,jax-tpu", "--topology", "v5e-4",
                   "--steps", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "results.json").read_text())
    assert [row["target"] for row in record["targets"]] == ["eager-cpu"]       # measured: what ran here
    (row,) = record["estimates"]
    assert row["target"] == "jax-tpu" and row["estimate"] is True and row["status"] == "ok"
    assert row["chips"] == 4 and row["fits"] and 0 < row["need_bytes"] < row["hbm_bytes"] == 16 * GIB
    assert row["step_bound_ms"] > 0 and row["compile_s"] > 0
    assert "jax-tpu" not in (out / "results.csv").read_text()                 # never among the measured columns
    report = (out / "report.md").read_text()
    assert "Compiled for TPU topology v5e-4 on this machine, not run (ESTIMATES" in report
    assert "ESTIMATES" in proc.stdout


@pytest.mark.cli
def test_compare_topology_needs_a_target_to_compile():
    proc = run_cli("compare", str(PROGRAMS / "mlp.py"), "--backends", "eager-cpu", "--topology", "v5e-4")
    assert proc.returncode == 2
    assert "--topology v5e-4: no target of --backends is compiled for it" in one_error_line(proc)


@pytest.mark.cli
def test_jax_cpu_runs_never_load_libtpu():
    """libtpu installed (for xbridge compile) is never loaded by a CPU run: no TPU warnings on its stderr."""
    import importlib.util

    assert importlib.util.find_spec("libtpu") is not None     # installed by make setup (the tpu-compile extra)
    proc = run_cli("run", str(PROGRAMS / "mlp.py"), "--backend", "jax-cpu", "--steps", "2", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert "TPU" not in proc.stderr and "libtpu" not in proc.stderr, proc.stderr
