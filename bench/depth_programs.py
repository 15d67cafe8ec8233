"""The shipped GPT (programs/gpt.py: 256 wide, 4 heads, 256 tokens, batch 16) at 2, 8 and 24 layers, each unrolled
and with its layers scanned (``StepOptions(scan_layers=True)``), for bench/depth.py:
``xbridge run bench/depth_programs.py:gpt_24_scan --backend jax-cpu``; and the long-sequence GPT scanned, for
bench/remat.py."""

import dataclasses
import runpy
from pathlib import Path

gpt = runpy.run_path(str(Path(__file__).resolve().parents[1] / "programs" / "gpt.py"))

for _layers in (2, 8, 24):
    _program = gpt["gpt_program"](f"gpt-{_layers}", dim=256, layers=_layers, heads=4, seq=256, batch=16, lr=3e-3)
    globals()[f"gpt_{_layers}"] = _program
    globals()[f"gpt_{_layers}_scan"] = _program.replace(
        name=f"gpt-{_layers}-scan", step=dataclasses.replace(_program.step, scan_layers=True))

# bench/remat.py with the layers scanned: `bench/remat.py --program bench/depth_programs.py:gpt_seq1024_scan`
gpt_seq1024_scan = gpt["gpt_seq1024"].replace(
    name="gpt-seq1024-scan", step=dataclasses.replace(gpt["gpt_seq1024"].step, scan_layers=True))
