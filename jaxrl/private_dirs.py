"""Directories a config names that another user of the machine must not control.

A directory whose contents the run trusts (the compile cache, whose entries are executables the
trainer loads; the vLLM weight versions the server loads) must be this user's, and others must not
write into it: a planted entry would run as the trainer, a swapped file would be served. Each
directory above it must not let others replace it either (writable by others without the sticky
bit, which keeps them from renaming what is not theirs).
"""

from __future__ import annotations

import os
import stat

from jaxrl.fields import ConfigError


def check_private_dir(
  path: str, field: str, *, sticky_ok: bool = False, missing_ok: bool = False
) -> None:
  """``path`` (an existing directory) is this user's and no one else writes into it (with
  ``sticky_ok``: or only under the sticky bit, for a root the run makes a private directory in);
  and no directory above it is open to others without the sticky bit. With ``missing_ok``, a
  ``path`` not made yet passes on the directories above it that exist (checked before the run
  writes anything; check the directory again once it is made). A ConfigError naming ``field``
  otherwise."""
  if missing_ok and not os.path.lexists(path):
    _check_above(path, field)
    return
  try:
    st = os.stat(path)
  except OSError as e:
    raise ConfigError(field, f"{path}: {e.strerror}") from None
  if not stat.S_ISDIR(st.st_mode):
    raise ConfigError(field, f"{path} is not a directory")
  if st.st_uid != os.geteuid():
    raise ConfigError(
      field,
      f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): its owner could "
      "put files there that this run trusts; use a directory of your own",
    )
  open_to_others = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
  if open_to_others and not (sticky_ok and st.st_mode & stat.S_ISVTX):
    fix = "chmod go-w" + (", or one with the sticky bit (chmod +t)" if sticky_ok else "")
    raise ConfigError(
      field,
      f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): they could put "
      f"files there that this run trusts; use a directory only you can write ({fix})",
    )
  _check_above(path, field)


def _check_above(path: str, field: str) -> None:
  """No directory above ``path`` lets others rename what is in it (writable by others without
  the sticky bit); one that does not exist yet is made by the run, as this user's."""
  parent = os.path.dirname(os.path.abspath(path))
  while parent != os.path.dirname(parent):
    try:
      pst = os.stat(parent)
    except FileNotFoundError:
      parent = os.path.dirname(parent)
      continue
    if pst.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not pst.st_mode & stat.S_ISVTX:
      raise ConfigError(
        field,
        f"{parent}, above {path}, is writable by other users without the sticky bit "
        f"(mode {stat.S_IMODE(pst.st_mode):o}): they could replace {path}",
      )
    parent = os.path.dirname(parent)
