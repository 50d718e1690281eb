"""The JAX coordination service (no authentication: whoever reaches it can end every process)
listens on the address ``--coordinator_address`` gives, not on every interface."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from run_helpers import ROOT
from sidecar_helpers import listeners

PROCESS = """
import os, sys
from jaxrl.parallel import distributed
distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), cpu_devices=1)
print("joined", flush=True)
sys.stdin.read()  # hold the service until the test has looked
import jax
jax.distributed.shutdown()
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_the_coordinator_listens_on_the_given_address_only():
  port = _free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", PROCESS, f"127.0.0.1:{port}", str(i)],
      env=dict(os.environ, PYTHONPATH=ROOT),
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
    )  # fmt: skip
    for i in range(2)
  ]
  try:
    for p in procs:
      assert p.stdout.readline().strip() == "joined"
    on_port = [a for _, a, _ in listeners([procs[0].pid]) if a.endswith(f":{port:04X}")]
    # 127.0.0.1 (as IPv4, or IPv4-mapped on an IPv6 socket) alone, not [::] or 0.0.0.0
    loopback = {f"0100007F:{port:04X}", f"0000000000000000FFFF00000100007F:{port:04X}"}
    assert on_port and set(on_port) <= loopback, on_port
  finally:
    for p in procs:
      p.stdin.close()
    for p in procs:
      p.wait(timeout=120)
