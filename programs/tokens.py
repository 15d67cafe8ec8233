"""The GPT of programs/gpt.py trained on a token file of your own (nanoGPT's train.bin/val.bin layout), with the
validation loss and perplexity every 10 steps.

    python scripts/make_tokens.py                  # out/tokens/train.bin and val.bin from local text
    xbridge run programs/tokens.py --backend eager-cpu --steps 50

XBRIDGE_TOKENS=DIR reads DIR/train.bin and DIR/val.bin instead (uint16 token ids below 256, or change vocab_size and
the model's vocab to match your tokenizer).
"""

import os
from pathlib import Path

import xbridge as xb
from xbridge.program_file import load_program

TOKENS = Path(os.environ.get("XBRIDGE_TOKENS", Path(__file__).resolve().parents[1] / "out" / "tokens"))

train = xb.data.TokenFile(str(TOKENS / "train.bin"), seq_len=256, batch_size=16, dtype="uint16", vocab_size=256,
                          val_path=str(TOKENS / "val.bin"))

program = load_program(str(Path(__file__).with_name("gpt.py"))).replace(
    name="tokens",
    data=train,
    eval=xb.Eval(data=train.validation(batch_size=16), every=10, batches=4),
)
