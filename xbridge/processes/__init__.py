"""Several processes, one run: ``--processes P`` (P processes started here, on this machine) or ``--processes
cluster`` (this process is one of a job a cluster launcher started: a Slurm step, an Open MPI job, a Cloud TPU pod
slice, a Kubernetes job set). Every process runs the same run loop (SPMD: the same steps, the same compiled
program, each feeding the rows its own devices hold); process 0 writes what the run writes and prints the report,
the others write into a scratch folder of their own that is removed at the end.

- job.py: this process's place in a job (the environment a launcher sets, ``--processes``, joining);
- heartbeat.py: what a started process says it is doing, and the progress timeout;
- supervisor.py: starting the processes, watching them, and stopping them all when one fails or hangs;
- restarts.py: ``--max-restarts``, what is kept across the attempts of one job (and under torchrun's own restarts).

This package imports no ML framework: the supervisor that starts and watches the processes runs before any backend
is loaded. Running one target of compare or parity in an ``xbridge run`` subprocess of its own is not here but in
xbridge/run/isolated.py: it shares nothing with a job (no coordinator, no heartbeat, no joining), it is a whole
``xbridge run`` whose result is the run record, and it sits beside that record.
"""

from .heartbeat import HEARTBEAT, TIMEOUT, beat, beating, timeout_s
from .job import (
    CHILD,
    CLUSTER,
    COORDINATOR,
    COUNT,
    INDEX,
    JOIN_TIMEOUT,
    environment_job,
    follower_outputs,
    is_joining,
    join_timeout_s,
    joined,
    joining,
    must_start,
    parse,
    this_process,
    under_torchrun,
    wait_for_address,
)
from .restarts import earlier_steps, log_step, restarts, torchrun_attempt, torchrun_restarts, torchrun_resume
from .supervisor import GRACE_S, after_lost_peer, describe_exit, die_with_parent, free_port, start, temporary_folder

__all__ = ["CHILD", "CLUSTER", "COORDINATOR", "COUNT", "GRACE_S", "HEARTBEAT", "INDEX", "JOIN_TIMEOUT", "TIMEOUT",
           "after_lost_peer", "beat", "beating", "describe_exit", "die_with_parent", "earlier_steps", "environment_job",
           "follower_outputs", "free_port", "is_joining", "join_timeout_s", "joined", "joining", "log_step",
           "must_start", "parse", "restarts", "start", "temporary_folder", "this_process", "timeout_s",
           "torchrun_attempt", "torchrun_restarts", "torchrun_resume", "under_torchrun", "wait_for_address"]
