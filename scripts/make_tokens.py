"""Make a token file pair (train.bin, val.bin) from local text, for programs/tokens.py.

Tokens are the text's bytes (ids 0..255) stored as uint16 in the nanoGPT layout (a flat binary, no header); the last
10% of the text is the validation split. No network, no tokenizer download.

    python scripts/make_tokens.py                     # the Markdown and Python files of this repository
    python scripts/make_tokens.py --text a.txt b.txt --out out/tokens
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def default_texts() -> list[Path]:
    return sorted(p for pattern in ("*.md", "docs/**/*.md", "xbridge/**/*.py", "backends/**/*.py")
                  for p in ROOT.glob(pattern))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", nargs="*", type=Path, help="text files (default: this repository's docs and code)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "tokens", help="directory for train.bin, val.bin")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    args = parser.parse_args(argv)
    texts = args.text or default_texts()
    missing = [str(p) for p in texts if not p.is_file()]
    if missing:
        print(f"error: text file {missing[0]!r} does not exist", file=sys.stderr)
        return 2
    data = np.frombuffer(b"\n".join(p.read_bytes() for p in texts), dtype=np.uint8).astype(np.uint16)
    if not 0 < args.val_fraction < 1 or len(data) < 1000:
        print(f"error: need --val-fraction in (0, 1) and at least 1000 bytes of text, got {len(data)}",
              file=sys.stderr)
        return 2
    split = int(len(data) * (1 - args.val_fraction))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.bin", data[:split]), ("val.bin", data[split:])):
        part.tofile(args.out / name)
        print(f"{args.out / name}: {len(part):,} tokens (uint16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
