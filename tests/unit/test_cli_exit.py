"""A rank that joined a process group leaves with its command's status, without the interpreter's teardown."""

import os
import subprocess
import sys

PROGRAM = """
import socket, sys
import torch.distributed as dist
from dimuon.cli import leave_if_distributed
leave_if_distributed(5)  # no process group yet: returns
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
print("joined", flush=True)
sys.stdout.write("buffered")
leave_if_distributed(3)
print("not reached")
"""


def test_a_rank_leaves_with_its_status_and_its_output_flushed():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == "joined\nbuffered" and "not reached" not in done.stdout


DESTROYED = """
import socket, sys
import torch.distributed as dist
from dimuon.cli import leave_if_distributed
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
dist.destroy_process_group()  # as dimuon train does when it made the group
sys.stdout.write("done")
leave_if_distributed(4)
print("not reached", flush=True)
"""


def test_a_torchrun_rank_whose_group_is_gone_still_leaves_without_teardown():
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test"}
    done = subprocess.run(
        [sys.executable, "-c", DESTROYED], capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert done.returncode == 4, done.stderr[-2000:]
    assert done.stdout == "done"
    without = {k: v for k, v in env.items() if k != "TORCHELASTIC_RUN_ID"}
    plain = subprocess.run(
        [sys.executable, "-c", DESTROYED], capture_output=True, text=True, timeout=120, check=False, env=without
    )
    assert "not reached" in plain.stdout  # not a torchrun rank, no group: the command returns as usual
