"""`xbridge compare`: process isolation, failures in rows, the JSON/CSV schema and the plots. No timing asserted."""

from __future__ import annotations

import csv
import itertools
import json
import shlex
import subprocess
import sys

import numpy as np
import pytest

from helpers import PROGRAMS, ROOT, one_error_line, read_scalars, run_cli
from xbridge.compare.record import CompareRecord
from xbridge.contract import registry

pytestmark = [pytest.mark.cli, pytest.mark.slow]
PNG = b"\x89PNG\r\n\x1a\n"


def test_compare_every_available_target(tmp_path):
    proc = run_cli("compare", str(PROGRAMS / "mlp.py"), "--steps", "6", "--warmup", "2", "--devices", "2",
                   "--out", str(tmp_path), "--format", "json", "--tensorboard", str(tmp_path / "tb"),
                   "--profile", "steps=3:5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout)
    targets = [row["target"] for row in record["targets"]]
    assert targets[0] == "eager-cpu" and {"jax-cpu", "xla-cpu"} <= set(targets)
    assert record["flops_per_step"] == 6 * (64 * 256 + 256 * 256 + 256 * 10) * 64 - 2 * 64 * 256 * 64
    assert record["config_hash"] and record["machine"]["cpu_count"] >= 1
    for row in record["targets"]:
        assert row["status"] == "ok", row.get("error")
        m = row["metrics"]
        assert m["loss_parity"] is True and m["recompiles"] == 0
        assert m["attention"] == "-"        # the MLP calls no attention; the GPT's rows name their kernels
        assert m["step_ms_p10"] <= m["step_ms_median"] <= m["step_ms_p90"]
        assert 0 < m["mfu"] < 1 and m["achieved_tflops"] > 0
        assert m["samples_per_s"] == pytest.approx(64 / (m["step_ms_median"] / 1e3))
        assert m["peak_host_rss_mib"] > 50
        assert 0 <= m["steps_host_rss_mib"] < m["peak_host_rss_mib"]      # what the steps added to the peak
        assert len(row["losses"]) == 6
        sharded = registry.load(row["target"].rpartition("-")[0]).backend.sharded
        assert row["devices"] == (2 if sharded else 1)          # unsharded backends run on one device
        assert (tmp_path / "runs" / row["target"] / "run.json").exists()
        # the compile column says whether the persistent caches were cold or warm (eager compiles nothing)
        assert m["compile_cache"] in ((None,) if row["target"] == "eager-cpu" else ("cold", "warm", "partial"))
    assert record["targets"][0]["metrics"]["max_loss_dev"] == 0.0
    # xla-cpu ran in .venv-xla (xbridge/environments.py): every target started from this interpreter's weights
    assert record["shared_init"]["xla-cpu"] == "xla" and record["shared_init"]["eager-cpu"] == "here"
    assert (tmp_path / "initial_weights.npz").is_file()
    advice = record["recommendation"]      # every row passes: the fastest by median step time, and how to run it
    fastest = min(record["targets"], key=lambda row: row["metrics"]["step_ms_median"])
    assert advice["target"] == fastest["target"] and sorted(advice["passing"]) == sorted(targets)
    assert advice["excluded"] == {}
    assert advice["command"] == (f"xbridge run {PROGRAMS / 'mlp.py'} --backend {fastest['target']} --devices "
                                 f"{fastest['devices']}")
    again = run_cli(*shlex.split(advice["command"])[1:], "--steps", "2", "--format", "json")
    assert again.returncode == 0, again.stderr[-2000:]       # the command runs as given
    np.testing.assert_allclose([s["loss"] for s in json.loads(again.stdout)["steps"]], fastest["losses"][:2],
                               rtol=1e-6)
    assert "measured" in record["targets"][0]["metrics"]["peak_source"]
    with open(tmp_path / "results.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["target"] for r in rows] == targets
    assert float(rows[1]["step_ms_median"]) > 0 and rows[1]["loss_parity"] == "True"
    assert rows[1]["compile_cache"] in ("cold", "warm", "partial")
    for name in ("loss_deviation.png", "step_time.png", "mfu.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, name
    norms: dict[str, list[float]] = {}
    for row in record["targets"]:       # one TensorBoard run per target, a value per step of each scalar
        scalars = read_scalars(tmp_path / "tb" / row["target"])
        assert [step for step, _ in scalars["train/loss"]] == list(range(6))
        np.testing.assert_allclose([v for _, v in scalars["train/loss"]], row["losses"], rtol=1e-6)
        assert {"train/lr", "train/grad_norm", "time/step_ms", "time/tokens_per_s"} <= set(scalars)
        norms[row["target"]] = [v for _, v in scalars["train/grad_norm"]]
        assert all(len(values) == 6 and all(v > 0 for _, v in values) for tag, values in scalars.items()
                   if tag.startswith("time/step") or tag.startswith("time/tokens"))
    for target, values in norms.items():    # every stack reports the same gradient norm as eager, step by step
        assert all(v > 0 for v in values), target
        np.testing.assert_allclose(values, norms["eager-cpu"], rtol=1e-4, err_msg=target)
    for row in record["targets"]:       # each stack's own profiler traced steps 3 and 4 into its run folder
        profile = row["result"]["profile"]
        assert profile["steps"] == "steps=3:5" and profile["top_ops"], row["target"]
        assert all(path.startswith(str(tmp_path / "runs" / row["target"] / "profile")) for path in profile["traces"])
        if not row["target"].startswith("xla"):      # torch_xla takes no scope around a step (its sync refuses one)
            assert profile["marked_steps"] == [3, 4], (row["target"], profile)
    report = (tmp_path / "report.md").read_text()
    assert "Profile of jax-cpu (steps=3:5)" in report
    lines = report.splitlines()
    first = lines.index(next(line for line in lines if line.startswith("| target |")))
    table = [line for line in itertools.takewhile(lambda line: line.startswith("| "), lines[first:])][2:]
    assert [line.split(" | ")[0].removeprefix("| ") for line in table] == targets
    assert f"config hash `{record['config_hash']}`" in report and "measured: best of" in report
    assert "command: `xbridge compare " in report
    assert f"**Recommended: {advice['target']}.** {advice['reason']}." in report and advice["command"] in report
    git = record["provenance"]["git"]          # a clone of the project: its commit (None only without git)
    assert git is None or f"at commit `{git['commit'][:12]}`" in report
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["targets"][1]["target"] == targets[1]
    assert json.dumps(CompareRecord.from_json(written).to_json()) == json.dumps(written)    # read back as written
    # docs/results.md's compare section is regenerated from this folder; the text around the markers stays
    page = tmp_path / "results.md"
    page.write_text("# Results\n\nbefore\n<!-- compare:make-run begin -->\nold table\n"
                    "<!-- compare:make-run end -->\nreading of the figures\n")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "results_from_compare.py"), str(tmp_path),
                           "--results", str(page)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    assert text.startswith("# Results\n\nbefore\n<!-- compare:make-run begin -->\n## xbridge compare: ")
    assert "old table" not in text and text.endswith("<!-- compare:make-run end -->\nreading of the figures\n")
    assert table[0] in text and "measured 20" in text and "\n# " not in text
    page.write_text("no markers\n")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "results_from_compare.py"), str(tmp_path),
                           "--results", str(page)], capture_output=True, text=True)
    assert done.returncode == 2 and "compare:make-run begin" in one_error_line(done)
    assert page.read_text() == "no markers\n"


@pytest.mark.serial      # a hang detected within seconds: alone, after the rest (scripts/test.sh)
def test_a_killed_and_a_hanging_target_do_not_lose_the_others(tmp_path, monkeypatch):
    proc = run_cli("compare", str(ROOT / "tests" / "fixtures" / "faulty.py"), "--backends", "jax-cpu,xla-cpu",
                   "--steps", "4", "--warmup", "1", "--timeout", "20", "--out", str(tmp_path), "--format", "json")
    assert proc.returncode == 1                       # some target failed
    rows = {row["target"]: row for row in json.loads(proc.stdout)["targets"]}
    assert rows["eager-cpu"]["status"] == "ok"        # the reference is always run, and it is unharmed
    assert rows["jax-cpu"]["status"] == "failed" and rows["jax-cpu"]["error"].startswith("killed by signal 9")
    assert rows["xla-cpu"]["status"] == "timeout" and rows["xla-cpu"]["error"].startswith("no result after 20 s")
    written = json.loads((tmp_path / "results.json").read_text())
    assert [r["status"] for r in written["targets"]] == ["ok", "failed", "timeout"]
    assert (tmp_path / "loss_deviation.png").read_bytes().startswith(PNG)
    assert "- jax-cpu: killed by signal 9" in (tmp_path / "report.md").read_text()
    advice = written["recommendation"]
    assert advice["target"] is None and advice["command"] is None
    assert advice["reason"].startswith("no target but the reference eager-cpu passes parity at fp32 (jax-cpu failed: "
                                       "killed by signal 9")
    assert advice["excluded"]["xla-cpu"].startswith("timeout: no result after 20 s")
    from rich.console import Console

    from xbridge.cli import tables

    console = Console(record=True, width=120)     # the terminal's table of the same record, errors in full
    monkeypatch.setattr(tables, "console", console)
    tables.print_compare(CompareRecord.from_json(json.loads(proc.stdout)))
    human = console.export_text()
    assert "jax-cpu: failed: killed by signal 9" in human and "xla-cpu: timeout: no result after 20 s" in human
    assert "recommended: none: no target but the reference eager-cpu passes parity" in human


def test_target_variants_race_two_ways_into_one_compiler(tmp_path):
    proc = run_cli("compare", str(PROGRAMS / "mlp.py"), "--backends", "xla-cpu,xla:xla-mode=openxla", "--steps", "5",
                   "--warmup", "2", "--devices", "2", "--out", str(tmp_path), "--format", "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["target"]: row for row in json.loads(proc.stdout)["targets"]}
    assert list(rows) == ["eager-cpu", "xla-cpu", "xla-cpu:xla-mode=openxla"]
    for label in ("xla-cpu", "xla-cpu:xla-mode=openxla"):
        assert rows[label]["metrics"]["loss_parity"] is True and rows[label]["metrics"]["recompiles"] == 0
        assert rows[label]["devices"] == 2
    variant = json.loads((tmp_path / "runs" / "xla-cpu:xla-mode=openxla" / "run.json").read_text())
    assert variant["target"] == "xla-cpu" and variant["backend_options"] == {"xla_mode": "openxla"}
    # the record holds every option the backend declares, defaults filled in
    assert json.loads((tmp_path / "runs" / "xla-cpu" / "run.json").read_text())["backend_options"] == {
        "xla_mode": "lazy"}


@pytest.mark.parametrize("args,fragment", [
    (["--backends", "jax-cpu,foo-cpu"], "unknown target 'foo-cpu'"),
    (["--backends", "xla-cpu:compile-mode=default"], "target variant 'xla-cpu:compile-mode=default': target xla-cpu "
                                                      "takes no --compile-mode (it takes: --xla-mode)"),
    (["--backends", "xla-cpu:openxla"], "target variant 'xla-cpu:openxla': 'openxla' is not OPTION=VALUE"),
    (["--steps", "3", "--warmup", "3"], "compare needs --steps >= 2 and 0 < --warmup < --steps"),
    (["--backends", "xla-cuda"], "target xla-cuda is unavailable: torch_xla 2.9 has no CUDA support"),
    (["--timeout", "0"], "--timeout must be > 0 seconds"),
])
def test_bad_compare_input(tmp_path, args, fragment):
    proc = run_cli("compare", str(PROGRAMS / "mlp.py"), *args, "--out", str(tmp_path))
    assert proc.returncode == 2
    assert fragment in one_error_line(proc)


@pytest.mark.parametrize("command", ["compare", "parity"])
@pytest.mark.parametrize("reference,fragment", [
    ("jax-cpu", "--reference 'jax-cpu': the reference must be an eager target (eager-cpu, eager-cuda)"),
    ("eager-cuda", "target eager-cuda is unavailable: torch sees no CUDA device"),
    ("eager-gpu", "target eager-cuda is unavailable"),     # the alias, resolved and checked the same way
])
def test_the_reference_is_an_eager_target_this_machine_has(tmp_path, command, reference, fragment):
    """Checked before any target runs: nothing is written under --out."""
    out = tmp_path / "out"
    proc = run_cli(command, str(PROGRAMS / "mlp.py"), "--backends", "jax-cpu", "--reference", reference,
                   "--out", str(out))
    assert proc.returncode == 2
    assert fragment in one_error_line(proc)
    assert not any(out.rglob("*.json"))


def test_compare_warmup_follows_a_short_run(tmp_path):
    """--warmup defaults to 3, or steps - 1 when fewer steps are run (as `run`'s does)."""
    proc = run_cli("compare", str(PROGRAMS / "mlp.py"), "--backends", "eager-cpu", "--steps", "2", "--format",
                   "json", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout)
    assert record["options"]["warmup"] == 1 and record["targets"][0]["status"] == "ok"
    # one interpreter: every target initialises its own weights, and no weights file is written
    assert record["shared_init"] is None and not (tmp_path / "initial_weights.npz").exists()
    assert "--init-state" not in record["targets"][0]["command"]
