"""The sidecar's boundaries, without vLLM: what other users and other runs can reach, and what a
server may answer. A stand-in server (``FAKE_VLLM`` below, stdlib only) answers like vLLM's OpenAI
and dev endpoints; the launcher starts it through a stand-in interpreter, so the real launch path
(guard, Unix socket, environment, restarts, close) runs in seconds.

- The launched server's API is a Unix socket in a 0700 directory: no TCP port, and another user
  cannot connect (checked as ``nobody`` when the tests run as root).
- Weight versions go to a fresh 0700 directory per run; a root that other users control is refused.
- LoRA adapter names carry a random run id, and the path the server serves under the pushed name
  must be the one just written.
- After ``close`` nothing restarts a server; a ``/v1/models`` failure restarts it like any other;
  a start that does not come up counts against ``max_restarts``; token ids outside the vocabulary
  and impossible log-probs are refused, naming the server.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import platform
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from run_helpers import ROOT
from sidecar_helpers import NOBODY, as_nobody, socket_path, tcp_sockets

from jaxrl.config import ConfigError
from jaxrl.nn import model
from jaxrl.rollout import sidecar as sc
from jaxrl.rollout import unix_http
from jaxrl.rollout.engine import SampleRequest, forget_version
from jaxrl.rollout.sidecar import LaunchConfig, Sidecar, SidecarError, group_members, owned_pids
from jaxrl.rollout.vllm_api import RequestError, ServerError
from jaxrl.rollout.vllm_client import VllmClient
from jaxrl.rollout.vllm_engine import EngineConfig, VllmEngine

VOCAB = 32

FAKE_VLLM = r'''
"""A stand-in for vLLM's OpenAI server and dev endpoints (stdlib only), for tests without vLLM.

  python fake_vllm.py [--uds PATH | --host H --port P] [vLLM's other flags, ignored]

With $FAKE_VLLM_DIR set, every start appends its pid to $FAKE_VLLM_DIR/starts (the n-th line is
start n) and reads $FAKE_VLLM_DIR/spec.json: {"exit": [n, ...]} exits at once with code 3 (a server
that crashes at startup); {"silent": [n]} never listens; {"drop": {"n": {"/v1/models": k}}} closes
the connection of the first k such requests unanswered; {"hold": {"n": ["/v1/completions"]}} never
answers those requests; {"ignore_term": [n]} ignores SIGTERM (a server slow to stop).
"""

import json
import os
import signal
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeVllm:
    def __init__(self):
        self.version = "default"
        self.adapters = {}  # name -> path
        self.reloads = []  # weights_path of each reload_weights
        self.requests = []  # (method, path, payload)
        self.served = []  # (model named by a completion request, the path it is served from)
        self.drop = {}  # path -> how many more requests to drop
        self.hold = set()
        self.release = threading.Event()
        # Not None: any adapter name is already taken, by a leftover served from this path.
        self.leftover_root = None
        self.tokens = [3, 4]
        self.logprobs = [-0.5, -0.25]
        self.lock = threading.Lock()

    def answer(self, method, path, payload):
        """(status, body, content type); None: drop the connection; "hold": never answer."""
        route = path.split("?")[0]
        with self.lock:
            self.requests.append((method, route, payload))
            if self.drop.get(route, 0) > 0:
                self.drop[route] -= 1
                return None
        if route in self.hold:
            return "hold"
        ok = lambda body="": (200, json.dumps(body) if body != "" else "", "application/json")
        if route == "/health":
            return ok()
        if route == "/v1/models":
            cards = [{"id": "base", "root": "/base"}]
            cards += [{"id": n, "root": p, "parent": "base"} for n, p in self.adapters.items()]
            return ok({"object": "list", "data": cards})
        if route == "/weight_info":
            return ok({"weight_version": self.version})
        if route in ("/pause", "/resume", "/reset_prefix_cache"):
            return ok()
        if route == "/collective_rpc":
            self.reloads.append(payload["kwargs"]["weights_path"])
            return ok({"results": [None]})
        if route == "/update_weight_version":
            self.version = payload["new_version"]
            return ok()
        if route == "/v1/load_lora_adapter":
            name = payload["lora_name"]
            if self.leftover_root is not None and name not in self.adapters:
                self.adapters[name] = self.leftover_root
            if name in self.adapters:
                message = f"The lora adapter '{name}' has already been loaded."
                return 400, json.dumps({"error": {"message": message}}), "application/json"
            self.adapters[name] = payload["lora_path"]
            return 200, f"Success: LoRA adapter '{name}' added successfully.", "text/plain"
        if route == "/v1/unload_lora_adapter":
            if self.adapters.pop(payload["lora_name"], None) is None:
                return 404, json.dumps({"error": {"message": "not found"}}), "application/json"
            return 200, "Success", "text/plain"
        if route == "/v1/completions":
            name = payload.get("model")
            if name is not None and name not in self.adapters:
                error = {"error": {"message": f"no model {name}"}}
                return 404, json.dumps(error), "application/json"
            self.served.append((name, self.adapters.get(name)))
            choice = lambda i: {
                "index": i,
                "token_ids": list(self.tokens),
                "logprobs": {"token_logprobs": list(self.logprobs)},
                "finish_reason": "length",
            }
            return ok({"choices": [choice(i) for i in range(payload["n"])]})
        return 404, json.dumps({"error": {"message": f"no route {route}"}}), "application/json"


class Handler(BaseHTTPRequestHandler):
    def handle_one(self, method):
        n = int(self.headers.get("Content-Length") or 0)
        payload = json.loads(self.rfile.read(n)) if n else None
        out = self.server.fake.answer(method, self.path, payload)
        if out == "hold":
            self.server.fake.release.wait()
            return
        if out is None:
            self.close_connection = True
            return
        status, body, content_type = out
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.handle_one("GET")

    def do_POST(self):
        self.handle_one("POST")

    def log_message(self, *args):
        pass


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def make_server(fake, address):
    """An HTTP server for ``fake`` on a Unix socket path (str) or a (host, port)."""
    if isinstance(address, str):
        server = UnixHTTPServer(address, Handler)
    else:
        server = ThreadingHTTPServer(address, Handler)
        server.daemon_threads = True
    server.fake = fake
    return server


def _flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def main(argv):
    state, spec, start = os.environ.get("FAKE_VLLM_DIR", ""), {}, 0
    if state:
        with open(os.path.join(state, "starts"), "a") as f:
            f.write(f"{os.getpid()}\n")
        with open(os.path.join(state, "starts")) as f:
            start = len(f.read().split())
        if os.path.exists(os.path.join(state, "spec.json")):
            with open(os.path.join(state, "spec.json")) as f:
                spec = json.load(f)
    if start in spec.get("exit", []):
        sys.exit(3)
    if start in spec.get("ignore_term", []):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if start in spec.get("silent", []):
        while True:
            time.sleep(3600)
    fake = FakeVllm()
    fake.drop = dict(spec.get("drop", {}).get(str(start), {}))
    fake.hold = set(spec.get("hold", {}).get(str(start), []))
    uds = _flag(argv, "--uds")
    address = uds or (_flag(argv, "--host") or "127.0.0.1", int(_flag(argv, "--port") or 8000))
    make_server(fake, address).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
'''

# The launcher's interpreter: the guard runs as Python; `-c` is the launcher's vLLM probe; `-m` (the
# API server module) runs the stand-in server instead.
FAKE_PYTHON = """#!/bin/sh
case "$1" in
  -c) exit 0 ;;
  -m) shift 2; exec {python} {server} "$@" ;;
  *) exec {python} "$@" ;;
esac
"""


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
  """(the stand-in server module, the stand-in interpreter's path)."""
  where = tmp_path_factory.mktemp("fake_vllm")
  server = where / "fake_vllm.py"
  server.write_text(FAKE_VLLM)
  python = where / "python"
  python.write_text(FAKE_PYTHON.format(python=sys.executable, server=server))
  python.chmod(0o755)
  spec = importlib.util.spec_from_file_location("fake_vllm", server)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module, str(python)


@pytest.fixture
def serve(fakes):
  """serve(address) -> (the in-process stand-in server's state, its URL); stopped after the test."""
  module, _ = fakes
  servers = []

  def start(address=("127.0.0.1", 0)):
    fake = module.FakeVllm()
    server = module.make_server(fake, address)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    servers.append((fake, server))
    if isinstance(address, str):
      return fake, unix_http.unix_url(address)
    return fake, f"http://127.0.0.1:{server.server_address[1]}"

  yield start
  for fake, server in servers:
    fake.release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def launched(fakes, tmp_path, monkeypatch):
  """launch(spec={}, **engine) -> an engine whose sidecar is the stand-in server, started by the
  real launcher (guard included); every start is a line of ``tmp_path/state/starts``. Closed
  after the test, like every engine ``_engine`` makes."""
  _, python = fakes
  state = tmp_path / "state"
  state.mkdir()
  monkeypatch.setenv("FAKE_VLLM_DIR", str(state))

  def launch(spec=None, lora_rank=0, **engine_kwargs):
    (state / "spec.json").write_text(json.dumps(spec or {}))
    launch_cfg = LaunchConfig(
      python=python, log_dir=str(tmp_path), startup_timeout=60.0, lora_rank=lora_rank
    )
    return _engine(tmp_path, launch=launch_cfg, lora=bool(lora_rank), **engine_kwargs)

  return launch


_ENGINES = []  # every engine a test makes, closed after it (their weights directories go)


@pytest.fixture(autouse=True)
def _close_engines():
  yield
  while _ENGINES:
    _ENGINES.pop().close()


def _starts(tmp_path) -> int:
  path = tmp_path / "state" / "starts"
  return len(path.read_text().split()) if path.exists() else 0


def _model_cfg(lora: bool):
  return model.ModelConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    rope_theta=1e6,
    tie_embeddings=False,
    lora_rank=4 if lora else 0,
  )


@pytest.fixture(scope="module")
def params():
  """Random params of the tiny model, without and with LoRA adapters."""
  return {lora: model.create(_model_cfg(lora), 0)[1] for lora in (False, True)}


def _engine(workdir, *, urls=(), launch=None, lora=False, **cfg):
  engine_cfg = EngineConfig(
    launch=launch,
    urls=tuple(urls),
    request_timeout=10.0,
    retries=cfg.pop("retries", 0),
    lora_adapters=lora,
    **cfg,
  )
  engine = VllmEngine(
    _model_cfg(lora), None, engine_cfg, workdir=str(workdir), max_new_tokens=4, eos_id=1, pad_id=0
  )
  _ENGINES.append(engine)
  return engine


def _generate(engine, params, version, n_questions=2, group=2):
  ids = np.full((n_questions, 3), 5, np.int32)
  mask = np.ones_like(ids, bool)
  counts = np.full(n_questions, group)
  return engine.generate(
    params, version, SampleRequest(ids, mask, counts, jax.random.PRNGKey(0), 1.0)
  )


# -- 1: the launched server's API --------------------------------------------------------------


def test_the_client_speaks_http_over_a_unix_socket(serve, tmp_path):
  """``http+unix://<quoted socket path>`` URLs, with the same error classes as TCP."""
  private = tmp_path / "private"
  private.mkdir(mode=0o700)
  fake, url = serve(str(private / "api.sock"))
  assert sc.healthy(url)
  client = VllmClient([url], timeout=5.0, retries=0)
  client.set_version(7)
  assert client.weight_version(url) == 7 and fake.version == "7"
  with pytest.raises(RequestError, match="HTTP 404"):
    client.post(url, "/no/such/route", {})
  gone = unix_http.unix_url(str(private / "missing.sock"))
  assert not sc.healthy(gone)
  with pytest.raises(ServerError):
    client.weight_version(gone)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_an_answer_sent_before_the_body_is_read_is_the_answer(tmp_path, transport):
  """A server that answers from the headers alone and closes (an unknown route's 404) while the
  body is still being written: the client reports that answer (RequestError, HTTP 404), not the
  body's broken pipe as a server failure; on a launched server's Unix socket and an attached
  server's TCP port alike."""
  if transport == "unix":
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "early.sock"))
    url = unix_http.unix_url(str(tmp_path / "early.sock"))
  else:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
  listener.listen(1)

  def answer_and_close():
    conn, _ = listener.accept()
    with conn:
      head = b""
      while b"\r\n\r\n" not in head:
        head += conn.recv(4096)
      conn.sendall(
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found"
      )

  server = threading.Thread(target=answer_and_close)
  server.start()
  client = VllmClient([url], timeout=30.0, retries=0)
  try:  # a body larger than the socket's buffers: its write is still under way at the close
    with pytest.raises(RequestError, match="HTTP 404: not found"):
      client.post(url, "/v1/load_lora_adapter", {"lora_path": "x" * (4 << 20)})
  finally:
    server.join()
    listener.close()


def test_the_launched_server_listens_on_a_private_unix_socket_alone(launched, params, tmp_path):
  """The stand-in server started by the real launcher: its API is a Unix socket in a 0700
  directory of this user's, it holds no TCP socket, vLLM's internal sockets and temporary files
  are pointed into that directory, gloo is kept on loopback; the directory goes with the server."""
  engine = launched()
  engine.set_weights(params[False], 0)
  path = socket_path(engine.sidecar.url)
  runtime = os.path.dirname(path)
  st = os.stat(runtime)
  assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
  assert stat.S_ISSOCK(os.stat(path).st_mode)
  server = engine.sidecar.server_pid()
  assert tcp_sockets(server) == []
  with open(f"/proc/{server}/environ", "rb") as f:
    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
  assert env[b"VLLM_RPC_BASE_PATH"] == env[b"TMPDIR"] == runtime.encode()
  assert env[b"GLOO_SOCKET_IFNAME"] == b"lo"
  if os.geteuid() == 0:  # another user: the directory keeps it from the socket
    assert as_nobody(engine.sidecar.url) == "EACCES"
  assert engine.client.weight_version(engine.sidecar.url) == 0
  engine.close()
  assert not os.path.exists(runtime)


_KILLED_TRAINER = """
import os, signal, sys
from jaxrl.rollout.sidecar import LaunchConfig, Sidecar
python, work = sys.argv[1], sys.argv[2]
sidecar = Sidecar(LaunchConfig(python=python, log_dir=work, startup_timeout=60.0))
sidecar.start(work)
print(os.getpid(), sidecar.group_ids[0], sidecar.runtime_dir, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_trainer_leaves_no_socket_directory(fakes, tmp_path, monkeypatch):
  """The trainer dies by SIGKILL and its server ignores SIGTERM: after the grace period the guard
  SIGKILLs the rest of its group, and itself lives to remove the socket directory."""
  _, python = fakes
  state = tmp_path / "state"
  state.mkdir()
  (state / "spec.json").write_text(json.dumps({"ignore_term": [1]}))
  monkeypatch.setenv("FAKE_VLLM_DIR", str(state))
  child = subprocess.run(
    [sys.executable, "-c", _KILLED_TRAINER, python, str(tmp_path)],
    capture_output=True,
    text=True,
    timeout=120,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
  trainer, group, runtime = child.stdout.split()
  assert os.path.isdir(runtime)
  deadline = time.time() + 60  # the guard's grace period is 10 s
  while (group_members(int(group)) or owned_pids(int(trainer))) and time.time() < deadline:
    time.sleep(0.2)
  assert not group_members(int(group)) and not owned_pids(int(trainer))
  assert not os.path.exists(runtime)


_TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine())  # the syscall's number


@pytest.mark.skipif(_TGKILL is None, reason="tgkill's syscall number is known for x86-64 and arm64")
def test_a_sigterm_the_guards_other_thread_takes_stops_the_server(fakes, tmp_path, monkeypatch):
  """The kernel hands a process-directed signal to any thread that does not block it (after a
  SIGSTOP / SIGCONT, to whichever wakes first). A SIGTERM the guard's watcher thread takes stops
  the server like one its main thread takes; here it is sent to that thread alone."""
  _, python = fakes
  state = tmp_path / "state"
  state.mkdir()
  (state / "spec.json").write_text("{}")
  monkeypatch.setenv("FAKE_VLLM_DIR", str(state))
  sidecar = Sidecar(LaunchConfig(python=python, log_dir=str(tmp_path), startup_timeout=60.0))
  sidecar.start(str(tmp_path))
  guard = sidecar.proc
  try:
    others = [int(t) for t in os.listdir(f"/proc/{guard.pid}/task") if int(t) != guard.pid]
    assert others  # the thread that watches the trainer
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(_TGKILL, guard.pid, others[0], signal.SIGTERM) == 0, ctypes.get_errno()
    guard.wait(timeout=60)  # a bound for the failure only: the guard polls its server every 0.25 s
    assert not group_members(guard.pid)
  finally:
    sidecar.close()


# -- 2: weights directories --------------------------------------------------------------------


def test_runs_sharing_a_weights_dir_write_to_private_directories(serve, params, tmp_path):
  """Two runs with the same ``vllm.weights_dir`` (and one on the tmpfs default): each writes its
  versions into a fresh 0700 directory of its own, which ``close`` removes."""
  fake, url = serve()
  shared = tmp_path / "shared"
  a = _engine(tmp_path, urls=[url], weights_root=str(shared))
  b = _engine(tmp_path, urls=[url], weights_root=str(shared))
  default = _engine(tmp_path, urls=[url])
  for engine in (a, b, default):
    engine.set_weights(params[False], 1)
  roots = [os.path.dirname(p) for p in fake.reloads]
  assert len(set(roots)) == 3, fake.reloads
  for engine, root in zip((a, b, default), roots):
    st = os.stat(root)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid(), root
  assert os.path.dirname(roots[0]) == os.path.dirname(roots[1]) == str(shared)
  for engine, root in zip((a, b, default), roots):
    engine.close()
    assert not os.path.exists(root)
  assert os.path.isdir(shared)  # the configured root itself stays


@pytest.mark.parametrize("case", ["writable", "not-owned", "sticky"])
def test_a_weights_dir_other_users_control_is_refused(serve, params, tmp_path, case):
  """A root others can write without the sticky bit (they could swap a version before a reload)
  or another user's root is refused, naming ``vllm.weights_dir``; a sticky one is accepted."""
  fake, url = serve()
  root = tmp_path / "root"
  root.mkdir()
  if case == "not-owned":
    if os.geteuid() != 0:
      pytest.skip("making a directory of another user's needs root")
    os.chown(root, NOBODY, NOBODY)
  else:
    root.chmod(0o1777 if case == "sticky" else 0o777)
  if case == "sticky":
    engine = _engine(tmp_path, urls=[url], weights_root=str(root))
    engine.set_weights(params[False], 1)
    assert os.path.dirname(os.path.dirname(fake.reloads[0])) == str(root)
    engine.close()
    return
  with pytest.raises(ConfigError) as e:
    _engine(tmp_path, urls=[url], weights_root=str(root)).set_weights(params[False], 1)
  assert e.value.field == "vllm.weights_dir"
  assert ("owned by uid" if case == "not-owned" else "writable by other users") in str(e.value)
  assert fake.reloads == []


def test_weight_versions_are_ints_and_strings_only_on_the_wire(serve, params, tmp_path):
  """The engine takes int versions and refuses anything else before writing a byte; the server's
  API stores a string, which the client writes from the int and reads back as one (a label no
  jaxrl client writes is refused, naming it)."""
  fake, url = serve()
  engine = _engine(tmp_path, urls=[url])
  for bad in ("1", "eval", "1-forget", 1.0, True):
    with pytest.raises(TypeError, match="weight version is an int"):
      engine.set_weights(params[False], bad)
    with pytest.raises(TypeError, match="weight version is an int"):
      _generate(engine, params[False], bad)
  with pytest.raises(TypeError, match="weight version is an int"):
    engine.client.set_version("7")
  assert fake.reloads == [] and fake.version == "default"
  assert engine.client.weight_version(url) is None
  engine.set_weights(params[False], forget_version(1))
  assert fake.version == "-4" and engine.client.weight_version(url) == -4 == engine.version
  engine.set_weights(params[False], np.int64(2))  # numpy ints too (an Issue read back)
  assert fake.version == "2" and engine.version == 2 and type(engine.version) is int
  assert _generate(engine, params[False], 2).tokens_RxN.shape[0] == 4
  fake.version = "2-forget"
  with pytest.raises(ServerError, match="weight version '2-forget', not an int"):
    engine.client.weight_version(url)


# -- 3: LoRA adapter names ---------------------------------------------------------------------


def test_runs_sharing_a_server_serve_their_own_adapters(serve, params, tmp_path):
  """Two runs attached to one server (or one run and the leftovers of a crashed one): the same
  push number must not name the same adapter, or the second run samples from the first's."""
  fake, url = serve()
  a = _engine(tmp_path, urls=[url], lora=True, weights_root=str(tmp_path / "a"))
  b = _engine(tmp_path, urls=[url], lora=True, weights_root=str(tmp_path / "b"))
  for engine in (a, b):
    engine.set_weights(params[True], 1)
  _generate(b, params[True], 1)
  name, root = fake.served[-1]
  assert name.startswith("policy-") and root.startswith(str(tmp_path / "b")), fake.served
  _generate(a, params[True], 1)
  name_a, root_a = fake.served[-1]
  assert name_a != name and root_a.startswith(str(tmp_path / "a"))


def test_a_leftover_adapter_under_the_pushed_name_is_refused(serve, params, tmp_path):
  """The server already serves the pushed name from another path (it refuses the load as
  "already loaded"): the push fails, naming the server and both paths, instead of sampling from
  the leftover."""
  fake, url = serve()
  fake.leftover_root = "/elsewhere/a000001"
  engine = _engine(tmp_path, urls=[url], lora=True, weights_root=str(tmp_path / "w"))
  with pytest.raises(SidecarError, match=f"(?s){url}.*/elsewhere/a000001"):
    engine.set_weights(params[True], 1)


# -- 10: the engine's lifecycle ----------------------------------------------------------------


def test_nothing_restarts_after_close(launched, params, tmp_path):
  """``close`` while a rollout's requests are in flight (the server holds them): the failed
  rollout raises instead of restarting a server on the removed weights; later calls raise too."""
  engine = launched(spec={"hold": {"1": ["/v1/completions"]}})
  engine.set_weights(params[False], 0)
  engine.client.on_requests_sent = engine.close
  with pytest.raises(SidecarError, match="closed"):
    _generate(engine, params[False], 0)
  with pytest.raises(SidecarError, match="closed"):
    engine.set_weights(params[False], 1)
  with pytest.raises(SidecarError, match="closed"):
    _generate(engine, params[False], 0)
  assert _starts(tmp_path) == 1
  assert not any(group_members(g) for g in engine.sidecar.group_ids)


def test_close_during_a_start_stops_it(fakes, tmp_path, monkeypatch):
  """A server still starting when its sidecar is closed is stopped, and the start raises."""
  _, python = fakes
  state = tmp_path / "state"
  state.mkdir()
  (state / "spec.json").write_text(json.dumps({"silent": [1]}))
  monkeypatch.setenv("FAKE_VLLM_DIR", str(state))
  sidecar = Sidecar(LaunchConfig(python=python, log_dir=str(tmp_path), startup_timeout=300.0))
  errors = []

  def start():
    try:
      sidecar.start(str(tmp_path))
    except SidecarError as e:
      errors.append(e)

  starter = threading.Thread(target=start, daemon=True)
  starter.start()
  deadline = time.time() + 60
  while _starts(tmp_path) < 1 and time.time() < deadline:  # the server process is up
    time.sleep(0.02)
  sidecar.close()
  starter.join(timeout=60)
  assert not starter.is_alive()
  assert len(errors) == 1 and "closed" in str(errors[0])
  assert not any(group_members(g) for g in sidecar.group_ids)
  with pytest.raises(SidecarError, match="closed"):
    sidecar.start(str(tmp_path))


def test_a_models_failure_is_a_server_error_and_restarts(serve, launched, params, tmp_path):
  fake, url = serve()
  fake.drop["/v1/models"] = 1
  with pytest.raises(ServerError, match="/v1/models"):
    VllmClient([url], retries=0).models(url)
  # An adapter push checks the served models; the first server drops those requests.
  engine = launched(spec={"drop": {"1": {"/v1/models": 10}}}, lora_rank=8)
  engine.set_weights(params[True], 0)
  assert _starts(tmp_path) == 2
  _generate(engine, params[True], 0)


def test_a_start_that_does_not_come_up_counts_as_a_failure(launched, params, tmp_path):
  """A (re)start whose server exits before it is healthy is retried, within ``max_restarts``."""
  engine = launched(spec={"exit": [1]}, max_restarts=1)
  engine.set_weights(params[False], 0)
  assert _starts(tmp_path) == 2
  engine.close()
  broken = launched(spec={"exit": [3, 4, 5]}, max_restarts=2)
  with pytest.raises(SidecarError, match="(?s)vllm.max_restarts.*exited with code 3"):
    broken.set_weights(params[False], 0)
  assert _starts(tmp_path) == 5  # the first start and two restarts


@pytest.mark.parametrize(
  "tokens, logprobs, refused",
  [
    ([3, VOCAB], [-0.5, -0.5], f"token id {VOCAB}"),
    ([-1, 3], [-0.5, -0.5], "token id -1"),
    ([3, 4], [-0.5, float("nan")], "log-prob nan"),
    ([3, 4], [float("-inf"), -0.5], "log-prob -inf"),
    ([3, 4], [-0.5, 0.5], "log-prob 0.5"),
    ([3, 4], [-0.5], "2 token ids and 1 log-probs"),
    ([VOCAB - 1, 0], [0.0, 1e-6], None),  # the largest id; a certain token's rounding
  ],
)
def test_token_ids_and_logprobs_are_checked(serve, params, tmp_path, tokens, logprobs, refused):
  """JAX clamps an out-of-range token id without a word; the server's answer is refused instead,
  naming it."""
  fake, url = serve()
  fake.tokens, fake.logprobs = tokens, logprobs
  engine = _engine(tmp_path, urls=[url])
  engine.set_weights(params[False], 0)
  if refused is None:
    out = _generate(engine, params[False], 0)
    assert out.tokens_RxN[0, : len(tokens)].tolist() == tokens
    return
  with pytest.raises(SidecarError, match=f"{url}.*{refused}"):
    _generate(engine, params[False], 0)


def test_an_attached_trainer_killed_outright_leaves_no_weights_behind(serve, tmp_path):
  """With vllm.urls no sidecar guard runs; a janitor in its own session removes the engine's
  weights directory (a model per version, on tmpfs) once the trainer is SIGKILLed."""
  from run_helpers import wait_until

  _, url = serve()
  trainer = subprocess.Popen(
    [sys.executable, os.path.join(ROOT, "tests", "attached_trainer.py"), url, str(tmp_path)],
    env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE, text=True,
  )  # fmt: skip
  try:
    root = trainer.stdout.readline().strip()
    assert os.path.basename(root).startswith("jaxrl-weights-") and os.listdir(root), root
  finally:
    trainer.kill()
    trainer.wait()
  wait_until(lambda: not os.path.exists(root), 60, f"{root} removed after the trainer's SIGKILL")
