"""A fake OpenAI-compatible chat endpoint on a real socket on 127.0.0.1, for the judge's tests
(tests/test_judge.py) and the multi-process reward terms' (tests/test_multihost_reward_terms.py)."""

from __future__ import annotations

import http.server
import json
import threading


def chat(content) -> tuple[int, bytes]:
  message = {"role": "assistant", "content": content}
  body = {"object": "chat.completion", "choices": [{"message": message}]}
  return 200, json.dumps(body).encode()


class ChatServer:
  """An OpenAI-compatible endpoint on 127.0.0.1: ``GET /v1/models`` lists ``model``; each
  ``POST /v1/chat/completions`` is answered by ``reply(prompt, tries, release)`` → (status, body),
  where ``tries`` counts the requests with that prompt so far and ``release`` is the event a
  handler that must not answer yet waits on. Every request is recorded as it is read."""

  def __init__(self, reply, model="judge-1"):
    self.reply, self.model = reply, model
    self.requests: list[tuple[str, dict, dict]] = []  # (path, headers, body)
    self.release = threading.Event()  # blocked handlers go on once set
    self._lock = threading.Lock()
    server = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *args):  # quiet
        pass

      def do_GET(self):
        server.answer(self, self.path, {})

      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server.answer(self, self.path, body)

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
    self.thread.start()

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.httpd.server_address[1]}"

  def answer(self, handler, path: str, body: dict) -> None:
    with self._lock:
      self.requests.append((path, dict(handler.headers), body))
      prompt = body["messages"][0]["content"] if body else ""
      tries = sum(1 for p, _, b in self.requests if b and b["messages"][0]["content"] == prompt)
    if path == "/v1/models":
      status, data = 200, json.dumps({"data": [{"id": self.model}]}).encode()
    else:
      status, data = self.reply(prompt, tries, self.release)
    try:
      handler.send_response(status)
      if 300 <= status < 400:
        handler.send_header("Location", f"{self.url}/elsewhere")
      handler.send_header("Content-Length", str(len(data)))
      handler.end_headers()
      handler.wfile.write(data)
    except OSError:  # the client gave up (a time-out, a reply too long): nothing to answer
      pass

  def chats(self) -> list[dict]:
    return [b for p, _, b in self.requests if p == "/v1/chat/completions"]

  def close(self) -> None:
    self.release.set()
    self.httpd.shutdown()
    self.httpd.server_close()
