"""programs/gpt.py at the width and depth given by XB_SCALING_DIM and XB_SCALING_LAYERS (bench/scaling.py)."""
import os
import runpy
from pathlib import Path

gpt = runpy.run_path(str(Path(__file__).resolve().parents[1] / "programs" / "gpt.py"))
dim = int(os.environ.get("XB_SCALING_DIM", "256"))
layers = int(os.environ.get("XB_SCALING_LAYERS", "4"))
program = gpt["program"].replace(name=f"gpt-d{dim}-l{layers}",
                                 model=lambda: gpt["GPT"](vocab=256, dim=dim, layers=layers, heads=4, seq=256))
