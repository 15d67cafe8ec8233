"""A worker rank of the distributed Inductor executable: ``python -m xbridge.backends.inductor.worker FD``.

Started by rank 0 (proxy.py) with one end of a socket pair as file descriptor FD. It loads the same program file,
applies rank 0's configuration, joins the process group, and then runs each call rank 0 sends (``rpc.serve``),
answering ``("ok", value)`` or ``("error", kind, message)``."""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection


def main() -> None:
    import signal

    from xbridge.plugin import die_with_parent

    conn = Connection(int(sys.argv[1]))
    die_with_parent()       # the kernel kills this worker when rank 0's process ends, however it ends
    # Ctrl-C reaches the whole process group: rank 0 decides (it finishes the step, checkpoints, then stops us)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup = conn.recv()
    rank = setup["rank"]
    debug_dir = os.environ.get("TORCH_COMPILE_DEBUG_DIR")
    if debug_dir:   # --dump: each rank writes its graphs and generated code in its own folder
        os.environ["TORCH_COMPILE_DEBUG_DIR"] = os.path.join(debug_dir, f"rank{rank}")
    try:
        import datetime

        import torch.distributed as dist

        from xbridge.ir.program import Program
        from xbridge.plugin import load_program, with_rng

        from .rank_engine import RankEngine, device_for, process_group_backend
        from .rpc import serve

        source = load_program(f"{setup['file']}:{setup['attr']}")
        program = Program.from_config(setup["config"], model=source.model, loss=source.loss, data=source.data,
                                      eval=source.eval)
        if program.config_hash != setup["config_hash"]:
            raise RuntimeError(f"the program rebuilt from {setup['file']} has config {program.config_hash}, rank 0 "
                               f"has {setup['config_hash']}")
        conn.send(("ok", None))   # start
        timeout = datetime.timedelta(seconds=setup["timeout"])
        store = dist.TCPStore("127.0.0.1", setup["port"], setup["world"], is_master=False, timeout=timeout)
        dist.init_process_group(process_group_backend(setup["device"]), store=store, rank=rank,
                                world_size=setup["world"], timeout=timeout)
        from xbridge.plugin import cache_dir

        from .patches import remember_isa_probes

        remember_isa_probes(cache_dir("inductor") / "isa_probes")     # as rank 0's configure() did
        engine = RankEngine(with_rng(program), setup["plan"], device_for(setup["device"], rank), setup["mode"])
        conn.send(("ok", None))   # setup
    except BaseException as exc:
        try:
            text = str(exc).strip()
            conn.send(("error", type(exc).__name__, text.splitlines()[0] if text else repr(exc)))
        finally:
            import traceback

            traceback.print_exc()
            os._exit(1)

    def receive() -> object:
        try:
            return conn.recv()
        except (EOFError, OSError):   # rank 0 is gone
            os._exit(1)

    serve(engine, receive, conn.send)
    dist.destroy_process_group()
    conn.close()


if __name__ == "__main__":
    main()
