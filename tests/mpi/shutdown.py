"""Run under `mpirun -np 2`: rank 0 gets SIGINT mid-loop, broadcasts SHUTDOWN, all exit 0.

Mirrors the engine loop: rank 0 sends a plan per step, workers execute until SHUTDOWN."""
import os
import signal

import numpy as np

from numa_runtime.distributed import ShutdownSignal, broadcast_shutdown, init_distributed
from numa_runtime.plan import SHUTDOWN, StepPlan

comm = init_distributed()
stop = ShutdownSignal(comm).install()
step = 0
if comm.rank == 0:
    while not stop.requested:
        plan = StepPlan.shutdown()
        plan.kind, plan.step_id = 1, step
        comm.broadcast_plan(plan)
        comm.all_reduce_(np.ones(8, np.float32))
        step += 1
        if step == 5:
            os.kill(os.getpid(), signal.SIGINT)
    broadcast_shutdown(comm)
    os.write(1, b"rank 0 stopped after %d steps\n" % step)  # one write: ranks must not interleave
else:
    while (plan := comm.broadcast_plan(None)).kind != SHUTDOWN:
        comm.all_reduce_(np.ones(8, np.float32))
        step += 1
    os.write(1, b"rank %d stopped after %d steps\n" % (comm.rank, step))
