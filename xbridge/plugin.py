"""What a backend plugin may use of xbridge, besides the contract (xbridge.contract), the IR (xbridge.ir), the
torch-side helpers every torch-based lowering shares (xbridge.torch), the errors (xbridge.errors) and the user's API
(the names of ``xbridge.__all__``). A backend imports xbridge through these alone (tests/test_plugin_api.py fails
otherwise), so the core can move its modules without breaking a plugin: what is here keeps its name and meaning.

Names are grouped by the service they give; a name bound to a module (``hints``, ``measure``, ``shards``, ``job``,
``warm``, ``data_source``) gives that module's public functions as a whole. docs/adding-a-backend.md lists them.
This module imports no ML framework.
"""

from xbridge import hints
from xbridge.aot import measure
from xbridge.aot.environment import compile_note, libtpu_version, prepare_process, tpu_chips_on_this_machine
from xbridge.aot.record import EVAL, INIT, TRAIN, CompiledProgram
from xbridge.aot.topology import Topology
from xbridge.cache import cache_dir
from xbridge.checkpoint import shards
from xbridge.data import source as data_source
from xbridge.data.source import BatchCheck, checked_batch, source_name
from xbridge.files import write_text
from xbridge.planner import ShardingPlan
from xbridge.processes import (
    beating,
    describe_exit,
    die_with_parent,
    is_joining,
    job,
    temporary_folder,
    torchrun_restarts,
    under_torchrun,
    warm,
)
from xbridge.program_file import load_program, source_of, user_frame
from xbridge.run.feed import Feed
from xbridge.run.framework_noise import native_lines_dropped
from xbridge.run.rng import rng_rows, with_rng

__all__ = [
    # the plan a backend lowers
    "ShardingPlan",
    # the user's data: a batch or a process's rows of it, checked as the run checks it
    "BatchCheck", "Feed", "checked_batch", "data_source", "source_name",
    # randomness: the rows each device draws for, and a program's stream (--rng)
    "rng_rows", "with_rng",
    # the user's program file: loading it in another process, naming its frames in an error
    "load_program", "source_of", "user_frame",
    # several processes: the job a process belongs to, its heartbeat, starting and describing processes
    "beating", "describe_exit", "die_with_parent", "is_joining", "job", "temporary_folder", "torchrun_restarts",
    "under_torchrun", "warm",
    # sharded checkpoints: the pieces a process writes
    "shards",
    # compile-ahead for a TPU slice: the topology, the record of a compiled program, measuring it
    "EVAL", "INIT", "TRAIN", "CompiledProgram", "Topology", "compile_note", "libtpu_version", "measure",
    "prepare_process", "tpu_chips_on_this_machine",
    # files and caches: xbridge's compile cache folders, atomic writes, native noise
    "cache_dir", "native_lines_dropped", "write_text",
    # sharding hints inside a model (xb.shard)
    "hints",
]
