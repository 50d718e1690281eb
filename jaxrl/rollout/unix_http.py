"""HTTP over a Unix socket, through urllib: ``http+unix://`` URLs (``unix_url``: the socket's
quoted path as the host) and ``urlopen``, which opens them and ``http://`` URLs alike, with the same
errors and timeouts. A launched sidecar's API listens on a Unix socket (``sidecar``'s docstring says
why); its clients (``vllm_client``, a served judge) speak HTTP over it. Both transports read a
server's answer even when it closed before the request's body was written.
"""

from __future__ import annotations

import http.client
import os
import socket
import urllib.parse
import urllib.request

UNIX_SCHEME = "http+unix"


def unix_url(path: str) -> str:
  """The URL of an HTTP server on the Unix socket ``path``: ``http+unix://`` + the quoted path."""
  return f"{UNIX_SCHEME}://{urllib.parse.quote(os.path.abspath(path), safe='')}"


class _AnswerBeforeBody(http.client.HTTPConnection):
  """A connection that reads a server's answer even when the server closed while the request's
  body was still being written (both transports: one client path)."""

  def send(self, data) -> None:
    """A server may answer from the headers alone and close (404 on a route it does not serve)
    before the body is written: the body's write then fails with EPIPE, but the answer is
    already in the socket. Let ``getresponse`` read it; a server that closed without one is
    still an error there (``RemoteDisconnected``)."""
    try:
      super().send(data)
    except (BrokenPipeError, ConnectionResetError):
      pass


class _TcpConnection(_AnswerBeforeBody):
  """HTTP over TCP (an attached server's ``http://`` URL)."""


class _UnixConnection(_AnswerBeforeBody):
  """HTTP on the Unix socket whose path urllib hands over as the request's (unquoted) host."""

  def __init__(self, path: str, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, **kwargs):
    super().__init__("localhost", timeout=timeout, **kwargs)
    self.path = path

  def connect(self) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      if self.timeout is not socket._GLOBAL_DEFAULT_TIMEOUT:
        sock.settimeout(self.timeout)
      sock.connect(self.path)
    except BaseException:
      sock.close()
      raise
    self.sock = sock


class _UnixHandler(urllib.request.AbstractHTTPHandler):
  """urllib's handler for ``http+unix`` URLs: the same requests, errors (``URLError`` for a
  missing socket or a refused connection, ``HTTPError`` for a status >= 400) and timeouts as
  ``http``."""

  def _open(self, req):
    return self.do_open(_UnixConnection, req)

  def _request(self, req):
    if not req.has_header("Host"):
      req.add_unredirected_header("Host", "localhost")  # not the socket's path
    return self.do_request_(req)

  def _response(self, req, response):
    if not 200 <= response.code < 300:
      response = self.parent.error(
        "http", req, response, response.code, response.msg, response.info()
      )
    return response


class _TcpHandler(urllib.request.HTTPHandler):
  """urllib's ``http`` handler on ``_TcpConnection``."""

  def http_open(self, req):
    return self.do_open(_TcpConnection, req)


# urllib finds a handler's methods by name: <scheme>_open, <scheme>_request, <scheme>_response.
for _kind in ("open", "request", "response"):
  setattr(_UnixHandler, f"{UNIX_SCHEME}_{_kind}", getattr(_UnixHandler, f"_{_kind}"))
_OPENER = urllib.request.build_opener(_UnixHandler(), _TcpHandler())


def urlopen(url_or_request, timeout: float):
  """``urllib.request.urlopen`` for http(s) and ``http+unix`` URLs alike."""
  return _OPENER.open(url_or_request, timeout=timeout)
