"""A sandboxed Python runner for the `python` tool: the code runs in a separate, fresh interpreter that is killed on
its wall-clock timeout, under resource limits, in its own temporary directory, with no network and no writes outside
that directory.

The limits, from the outside in:
- a new process group, killed with SIGKILL at `timeout_s` (wall clock), RLIMIT_CPU a second later;
- RLIMIT_AS (`memory_mb`), RLIMIT_FSIZE (the output file and any file it writes), RLIMIT_NOFILE;
- Linux Landlock (kernel >= 5.13): writes allowed beneath the temporary directory only, and from ABI 4 no TCP bind or
  connect;
- a seccomp filter: socket(2) and socketpair(2) fail with EPERM, and new processes or programs (fork, vfork, clone,
  clone3, execve, execveat) likewise;
- a Python audit hook (PEP 578) that refuses sockets, subprocesses, ctypes and opening files for writing outside the
  directory, with a readable error: the message the model sees, and the only layer where the kernel has neither
  Landlock nor seccomp (`kernel_layers()` says which are active).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

# Runs in the child before the user's code (`python -I -S -c BOOTSTRAP TMPDIR MEMORY_MB CPU_S OUTPUT_BYTES`); the
# code comes on stdin. Imports are done before the limits, which then hold for the rest of the process's life.
BOOTSTRAP = r'''
import ctypes, io, os, resource, struct, sys, traceback
tmp, memory_mb, cpu_s, output_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
code = sys.stdin.read()
os.chdir(tmp)
libc = ctypes.CDLL(None, use_errno=True)
active = []

def landlock():
  abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
  if abi < 1:
    return
  write = 1 << 1 | sum(1 << b for b in range(4, 13))  # WRITE_FILE, REMOVE_*, MAKE_*
  write |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)  # REFER, TRUNCATE
  net = 3 if abi >= 4 else 0  # BIND_TCP | CONNECT_TCP: handled, no rule allows them
  attr = struct.pack("QQ", write, net) if net else struct.pack("Q", write)
  ruleset = libc.syscall(444, attr, len(attr), 0)
  if ruleset < 0:
    return
  fd = os.open(tmp, os.O_PATH)
  beneath = struct.pack("=Qi", write, fd)
  if libc.syscall(445, ruleset, 1, beneath, 0) == 0 and libc.prctl(38, 1, 0, 0, 0) == 0 \
      and libc.syscall(446, ruleset, 0) == 0:
    active.append("landlock" + ("+net" if net else ""))
  os.close(fd)
  os.close(ruleset)

def seccomp():
  import platform
  arch, denied = {"x86_64": (0xC000003E, (41, 53, 56, 57, 58, 59, 322, 435)),
                  "aarch64": (0xC00000B7, (198, 199, 220, 221, 281, 435))}.get(platform.machine(), (None, ()))
  if arch is None:
    return
  allow, eperm, kill = 0x7FFF0000, 0x00050000 | 1, 0x80000000
  prog = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, kill), (0x20, 0, 0, 0)]
  for nr in denied:
    prog += [(0x15, 0, 1, nr), (0x06, 0, 0, eperm)]
  prog.append((0x06, 0, 0, allow))
  raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
  buf = ctypes.create_string_buffer(raw)
  fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(buf))
  if libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0:
    active.append("seccomp")

def hook(event, args):
  if event.startswith(("socket.", "subprocess.", "os.exec", "os.fork", "os.posix_spawn", "os.spawn", "os.system",
                       "ctypes.", "pty.")):
    raise PermissionError(f"sandbox: {event} is not allowed (no network, no processes)")
  if event == "open" and args[0] is not None and not isinstance(args[0], int):
    mode, flags = args[1] or "r", args[2] or 0
    if any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
      path = os.path.realpath(os.fsdecode(args[0]))
      if os.path.commonpath([path, tmp]) != tmp:
        raise PermissionError(f"sandbox: writing {path} is not allowed (only beneath the working directory)")
  if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.truncate",
               "shutil.rmtree", "os.chmod", "os.chown", "os.utime"):
    for p in args:
      if isinstance(p, (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(p))
        if os.path.commonpath([path, tmp]) != tmp:
          raise PermissionError(f"sandbox: {event} on {path} is not allowed (only beneath the working directory)")

landlock()
seccomp()
resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
resource.setrlimit(resource.RLIMIT_FSIZE, (output_bytes, output_bytes))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
if os.environ.get("SANDBOX_REPORT"):
  print(",".join(active))
if not os.environ.get("SANDBOX_KERNEL_ONLY"):
  sys.addaudithook(hook)
del ctypes, libc
try:
  exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
except SystemExit:
  raise
except BaseException as e:
  frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != "<string>"][-3:]  # not this bootstrap
  print("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) +
        "".join(traceback.format_exception_only(e)), end="", file=sys.stderr)
  sys.exit(1)
'''


class SandboxTimeout(Exception):
  """The code ran past its wall-clock limit and was killed."""


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, output_bytes: int = 1 << 20,
               _report: bool = False, _kernel_only: bool = False) -> tuple[str, int]:
  """(stdout and stderr interleaved, exit status) of `code` run in the sandbox; raises SandboxTimeout when it was
  killed at `timeout_s`. Writing past `output_bytes` fails (EFBIG). `_kernel_only` leaves the audit hook out, so
  that tests can check the kernel layers alone."""
  tmp = tempfile.mkdtemp(prefix="jalign_sandbox_")
  try:
    out_path = os.path.join(tmp, ".output")
    env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    if _report:
      env["SANDBOX_REPORT"] = "1"
    if _kernel_only:
      env["SANDBOX_KERNEL_ONLY"] = "1"
    with open(out_path, "wb") as out:
      proc = subprocess.Popen(
          [sys.executable, "-I", "-S", "-B", "-c", BOOTSTRAP, tmp, str(memory_mb), str(int(timeout_s) + 1),
           str(output_bytes)], stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, cwd=tmp, env=env,
          start_new_session=True)
      try:
        proc.communicate(code.encode(), timeout=timeout_s)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise SandboxTimeout(f"killed after {timeout_s:g} s") from None
      finally:
        if proc.poll() is None:
          os.killpg(proc.pid, signal.SIGKILL)
          proc.wait()
    with open(out_path, "rb") as f:
      text = f.read(output_bytes).decode("utf-8", "replace")
    return text, proc.returncode
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def kernel_layers() -> list[str]:
  """The kernel layers active in a sandboxed process on this machine ("landlock[+net]", "seccomp")."""
  text, _ = run_python("", _report=True)
  return [x for x in text.strip().split(",") if x]
