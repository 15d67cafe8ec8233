"""The distributed Inductor executable as rank 0 sees it: a proxy that drives the other ranks.

Every call of the executable (init, step, state_dict, ...) is sent to ranks 1..N-1 before rank 0 runs it, so all
ranks enter the same collectives in the same order; each rank answers (its loss, or its error) and rank 0 returns
its own result. Two ways to get the other ranks (peers.py):

- by itself (``xbridge run --backend inductor-cpu --devices N``): the xbridge process is rank 0 and starts ranks
  1..N-1 (``python -m xbridge.backends.inductor.worker``), each connected to it by a private socket pair and writing
  its output to a log file;
- under torchrun (``RANK`` and ``WORLD_SIZE`` set): every rank runs ``xbridge run``; rank 0 goes on with the run,
  and the others turn into workers inside ``lower()``, taking their calls over a gloo group, and exit when rank 0
  is done, so only rank 0 writes results.
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from xbridge import errors
from xbridge.contract import (
    Executable,
    PieceWriter,
    Profiling,
    ShardedCheckpoint,
    Target,
)
from xbridge.errors import LoweringError, RunError
from xbridge.ir.program import Program
from xbridge.plugin import ShardingPlan, source_of, torchrun_restarts, under_torchrun

from . import rpc
from .peers import SpawnedPeers, TorchrunPeers, torchrun_worker
from .placement import MeshRoles
from .proxy_capabilities import RankDiagnosis, RankProbes
from .rank_engine import RankEngine, device_for, process_group_backend
from .rpc import quiet_stdout, timeout_s


def program_source(program: Program) -> tuple[str, str]:
    """The program file and attribute this program came from (workers load the same code and apply this
    program's configuration, so CLI overrides carry over)."""
    found = source_of(program)
    if found is None:
        raise LoweringError(f"program {program.name!r} was not loaded from a program file, but inductor on several "
                            "processes loads the program in each worker; run it from a file (xbridge run FILE.py) or "
                            "under torchrun")
    return found


def _attempt_store(timeout: datetime.timedelta) -> Any:
    """torchrun's store (``env://``) with this start's keys under a prefix of their own: torchrun keeps one store
    across its restarts (``--max-restarts``), and a restarted rank that read the group's keys of the start before
    would connect to a dead rank's address (gloo: "Connection refused")."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"xbridge-start-{torchrun_restarts()}/", store)


_live: list[DistributedExecutable] = []   # the spawned run of this process that owns the default group

@dataclass(frozen=True)
class RankStep:
    """The batch of step ``step``, which every rank reads for itself."""

    step: int


class DistributedExecutable(Executable, ShardedCheckpoint):
    """The Executable protocol over N processes (see the module docstring). Results are rank 0's; every rank
    computes the same loss, and each step checks that they agree. Its diagnostics and probes: proxy_capabilities.py;
    its profiler: rank 0's engine's."""

    reads_slices = False    # the weights and state go to the ranks whole, as numpy

    def __init__(self, program: Program, plan: ShardingPlan, target: Target, mode: str) -> None:
        self.program, self.plan, self.target, self.mode = program, plan, target, mode
        MeshRoles(plan)   # an unsupported layout fails here, before any process starts
        self.timeout = timeout_s()
        self._closed = False
        world = plan.devices
        backend = process_group_backend(target.device)
        pg_timeout = datetime.timedelta(seconds=self.timeout)
        self.peers: SpawnedPeers | TorchrunPeers
        if under_torchrun():
            have = int(os.environ["WORLD_SIZE"])
            if have != world:
                raise errors.ConfigError(f"torchrun started {have} processes but --devices is {world}; pass "
                                         f"--devices {have}")
            self.owns_group = not dist.is_initialized()
            with quiet_stdout():
                if self.owns_group:
                    dist.init_process_group(backend, store=_attempt_store(pg_timeout),
                                            rank=int(os.environ["RANK"]), world_size=have, timeout=pg_timeout)
                control = dist.new_group(backend="gloo", timeout=pg_timeout)
            rank = dist.get_rank()
            debug_dir = os.environ.get("TORCH_COMPILE_DEBUG_DIR")
            if debug_dir and rank:
                os.environ["TORCH_COMPILE_DEBUG_DIR"] = os.path.join(debug_dir, f"rank{rank}")
            self.device = device_for(target.device, int(os.environ.get("LOCAL_RANK", rank)))
            with quiet_stdout():
                engine = RankEngine(program, plan, self.device, mode)
            if rank:
                torchrun_worker(engine, control)   # does not return
            self.peers = TorchrunPeers(control, world)
            atexit.register(self.close)
            self.engine = engine
        else:
            self.owns_group = True
            file, attr = program_source(program)
            if _live and _live[-1] is not self:   # one default process group per process: retire the last run's
                _live[-1].close()
            store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=pg_timeout)
            setup = {"world": world, "port": store.port, "file": file, "attr": attr, "config": program.config(),
                     "config_hash": program.config_hash, "plan": plan, "device": target.device, "mode": mode,
                     "timeout": self.timeout}
            self.peers = SpawnedPeers(setup, world, self.timeout)
            _live.append(self)
            atexit.register(self.close)
            self.peers.replies("start")      # every worker loaded the program and is joining the group
            with quiet_stdout():
                dist.init_process_group(backend, store=store, rank=0, world_size=world, timeout=pg_timeout)
            self.device = device_for(target.device, 0)
            with quiet_stdout():
                self.engine = self._run("setup", lambda: RankEngine(program, plan, self.device, mode))
        self.parts = (RankDiagnosis(self), RankProbes(self), self.engine.capability(Profiling))
        self.peers.replies("setup")

    def _run(self, call: str, local: Callable[[], Any]) -> Any:
        """Rank 0's part of a call; a failure caused by another rank is reported as that rank's."""
        try:
            return local()
        except errors.XBridgeError:   # rank 0's own verdict on the program (every rank reaches the same)
            self.close(kill=True)
            raise
        except Exception as exc:
            failure = self.peers.failure(call)
            self.close(kill=True)
            if failure is not None:
                raise failure from exc
            raise

    def call(self, name: str, *args: Any) -> tuple[Any, list[Any]]:
        """``name`` run on every rank's engine; rank 0's result and the others' replies."""
        if self._closed:
            raise RunError(f"the inductor processes were stopped; {name} cannot run")
        self.peers.send(name, args)
        result = self._run(name, lambda: rpc.method(self.engine, name)(*args))
        try:
            replies = self.peers.replies(name)
        except Exception:
            self.close(kill=True)
            raise
        return result, replies

    def close(self, kill: bool = False) -> None:
        """Stop the other ranks (they exit when told; killed after 10 s, or at once with ``kill``)."""
        if self._closed:
            return
        self._closed = True
        self.peers.close(kill)
        if self in _live:
            _live.remove(self)
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ the Executable protocol

    def init(self, weights: dict[str, np.ndarray]) -> None:
        self.call("init", weights)

    def fetch(self, source: Any, step: int, seed: int, check: Callable[[Any, int], Any]) -> Any:
        """Nothing read here: each rank reads only its own rows of the step (RankEngine.step_at)."""
        return RankStep(step)

    def step(self, batch: Any) -> dict[str, float]:
        metrics, replies = (self.call("step_at", batch.step) if isinstance(batch, RankStep)
                            else self.call("step", batch))
        for rank, loss in enumerate(replies, start=1):
            if loss != metrics["loss"] and not (math.isnan(loss) and math.isnan(metrics["loss"])):
                raise RunError(f"inductor ranks disagree on the loss: rank 0 has {metrics['loss']!r}, rank {rank} "
                               f"{loss!r}")
        return metrics

    def evaluate(self, batch: dict[str, np.ndarray]) -> float:
        return self.call("evaluate", batch)[0]

    def state_dict(self) -> dict[str, np.ndarray]:
        return self.call("state_dict")[0]

    def training_state(self) -> dict[str, np.ndarray]:
        return self.call("training_state")[0]

    def load_training_state(self, state: dict[str, np.ndarray]) -> None:
        self.call("load_training_state", state)

    def piece_writer(self) -> PieceWriter | None:
        """Each rank writes its own pieces into the checkpoint's folder (backends/inductor/checkpoint_shards.py);
        one rank: None (the state is written whole)."""
        def write(tmp: Path) -> list[dict[str, Any]]:
            first, others = self.call("write_checkpoint_part", str(tmp))
            return [first, *others]

        return PieceWriter(write) if self.plan.devices > 1 else None
