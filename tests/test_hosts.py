"""Jobs across hosts, simulated on this machine (tests/simulated_hosts.py: a network namespace per host, its own
address): 2 hosts x 2 JAX processes x 2 devices started as a cluster starts them (the same command on every host,
the coordinator's address, the count and the index in the environment: ``--processes cluster``), one 8-device mesh
matching one process of 8 devices within the fp32 policy; its sharded checkpoint, written by both hosts into one
folder, resumed on one host; inductor's 2 hosts x 2 ranks under torchrun, matching eager on one process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import PROGRAMS, ROOT, run_cli, user_env
from simulated_hosts import hosts
from xbridge.parity import policy

pytestmark = [pytest.mark.slow, pytest.mark.cli]
GPT = str(PROGRAMS / "gpt.py")


def _across_hosts(per_host: int, args: list[str]) -> dict:
    """The same ``xbridge run ARGS --processes cluster`` on every process of 2 hosts; process 0's record."""
    with hosts(2) as machines:
        count = per_host * len(machines)
        coordinator = f"{machines[0].address}:12421"
        procs = []
        for index in range(count):
            env = {**user_env(), "JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(count),
                   "JAX_PROCESS_ID": str(index), "XBRIDGE_DEBUG": "0"}
            argv = [sys.executable, "-m", "xbridge", "run", *args, "--processes", "cluster", "--format", "json"]
            procs.append(subprocess.Popen(machines[index // per_host].command(argv, env), cwd=ROOT, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        outputs = [proc.communicate(timeout=600) for proc in procs]
    for index, (proc, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"process {index}: {err[-3000:]}"
    return json.loads(outputs[0][0])


@pytest.mark.parametrize("mode", ["gspmd", pytest.param("shard_map", marks=pytest.mark.extended)])
def test_two_hosts_of_two_processes_match_one_process(tmp_path, mode):
    """One 8-device mesh over 2 hosts x 2 processes x 2 devices, within the fp32 policy of eager on one process;
    the sharded checkpoint both hosts wrote into one folder resumed on one host (eager, one process: the pieces
    of 4 processes read back into one model). The shard_map case is in ``make test-extended`` (docs/testing.md)."""
    ckpt = tmp_path / "ckpt"
    record = _across_hosts(2, [GPT, "--backend", "jax-cpu", "--sharding-mode", mode, "--mesh", "data=-1,model=2",
                               "--devices", "2", "--steps", "3", "--checkpoint-dir", str(ckpt)])
    assert record["processes"] == 4 and record["devices"] == 8 and record["mesh"] == {"data": 4, "model": 2}
    # column-parallel over 'model': process 0's two devices each hold half the rows
    assert record["layout"]["blocks.0.up.weight"]["shard_shapes"] == [[512, 256]] * 2
    one = run_cli("run", GPT, "--backend", "eager-cpu", "--steps", "4", "--format", "json")
    assert one.returncode == 0, one.stderr[-3000:]
    single = [s["loss"] for s in json.loads(one.stdout)["steps"]]
    tol = policy.tolerance("fp32")
    losses = policy.loss_deviation(single[:3], [s["loss"] for s in record["steps"]], tol)
    assert losses.ok, losses
    (written,) = record["checkpoints"]
    assert written.endswith("step-00000003") and (ckpt / "step-00000003" / "COMMIT").exists()
    resumed = run_cli("run", GPT, "--backend", "eager-cpu", "--steps", "4", "--resume", str(ckpt), "--format",
                      "json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = json.loads(resumed.stdout)
    assert after["start_step"] == 3 and after["resumed_from"] == written
    assert policy.loss_deviation(single[3:], [s["loss"] for s in after["steps"]], tol).ok, (single, after["steps"])


def test_inductor_on_two_hosts_under_torchrun_matches_one_process():
    """Inductor across hosts as clusters start it: ``torchrun --nnodes 2 --rdzv-backend c10d`` on each host (2 ranks
    each, one 2x2 mesh: FSDP2 over 'data', tensor parallel over 'model'), within the fp32 policy of eager on one
    process. Rendezvous orders the hosts; the rank 0 the report comes from is on either."""
    args = [str(PROGRAMS / "mlp.py"), "--backend", "inductor-cpu", "--devices", "4", "--mesh", "data=2,model=2",
            "--steps", "3", "--format", "json"]
    with hosts(2) as machines:
        endpoint = f"{machines[0].address}:12431"
        procs = []
        for machine in machines:
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "xbridge-hosts",
                    "--local-addr", machine.address, "-m", "xbridge", "run", *args]
            procs.append(subprocess.Popen(machine.command(argv, {**user_env(), "XBRIDGE_DEBUG": "0"}), cwd=ROOT,
                                          text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        outputs = [proc.communicate(timeout=600) for proc in procs]
    for index, (proc, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"host {index}: {err[-3000:]}"
    (report,) = [out for out, _ in outputs if out.strip()]        # one document: only rank 0 reports
    record = json.loads(report)
    assert record["devices"] == 4 and record["mesh"] == {"data": 2, "model": 2}
    assert record["layout"]["fc1.weight"]["shard_shapes"] == [[128, 64]] * 4
    one = run_cli("run", *args[:1], "--backend", "eager-cpu", "--steps", "3", "--format", "json")
    assert one.returncode == 0, one.stderr[-3000:]
    single = [s["loss"] for s in json.loads(one.stdout)["steps"]]
    deviation = policy.loss_deviation(single, [s["loss"] for s in record["steps"]], policy.tolerance("fp32"))
    assert deviation.ok, deviation
