"""The python tool: runs code a model wrote in a separate, limited Python process, and says what came of it.

A rollout calls `run_python` with whatever the model wrote, so nothing the code does may crash, hang or flood the
training process. The code runs in a child interpreter (this file, run as a script) in a fresh empty folder,
with a minimal environment and limits on CPU time, memory and file size. The parent ends the child's whole
process group when the code ends, prints too much or runs past the wall-clock limit, so nothing it started
survives, and turns every outcome into a `SandboxResult` instead of raising.

Two layers keep the code in. Where the kernel allows it, the child enters new network and PID namespaces: no
network at all, and no process outside to signal. In every case an audit hook, which later code cannot remove,
refuses the network, starting processes, sending signals, ctypes calls, and files outside the working folder: the
code may write only there, and read only there and in the Python installation, so that the standard library and
installed packages still import. The hook sees only what Python itself does; native code in an installed
package (a database engine reading files, say) goes past it, and only the namespaces and limits still hold.

The limits are set by the child itself before the code runs, not in a `preexec_fn`: Python code between fork
and exec can deadlock in a multithreaded parent, which a training process is.
"""

from __future__ import annotations

import _posixsubprocess
import _signal
import codecs
import contextlib
import ctypes
import math
import os
import posix
import resource
import selectors
import signal
import site
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
import types
from dataclasses import dataclass

_MIB = 1024 * 1024
# Files the code writes are for scratch work; a few MiB each keeps it from filling the disk quickly.
_FILE_SIZE_LIMIT = 8 * _MIB
# Past the kept output, this much more is read and dropped before the child is killed, so a program that prints
# slightly too much still finishes and reports its own result.
_FLOOD_MARGIN_CHARS = 64 * 1024
_CHUNK_BYTES = 64 * 1024
# After the child has exited (or been killed), output still in the pipe is read for at most this long.
_DRAIN_S = 0.5
# How often the parent looks whether the child has exited while it waits for output: the longest a finished
# run waits for its result.
_POLL_S = 0.005
# How long a child sent SIGTERM has to end the code's processes and reap them before its group is killed.
_STOP_S = 1.0
# Held by the child while the code runs and freed when it raises, so that a MemoryError can still be described.
_MEMORY_RESERVE_BYTES = _MIB
_MAX_ERROR_CHARS = 1000
# The CPU time the kernel reports for a process it killed at the limit can fall a tick short of the limit.
_CPU_ACCOUNTING_SLACK_S = 0.05
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class SandboxResult:
    """What one run of the python tool gave: the text it printed (stdout and stderr together) and, when it did
    not finish cleanly, why, as one line the model can read."""

    output: str
    error: str | None
    timed_out: bool
    truncated: bool

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class _Limits:
    cpu_s: float
    wall_s: float
    memory_mb: int
    max_output_chars: int


def run_python(code: str, *, cpu_s: float = 5.0, wall_s: float = 10.0, memory_mb: int = 512,
               max_output_chars: int = 4000) -> SandboxResult:
    """Runs `code` as a __main__ module in a child Python process and returns what it printed and how it ended.

    Never raises: code that is not Python gives a SyntaxError line, an exception its last line as Python prints
    it (the output printed before it is kept), and the limits their own messages. `cpu_s` is CPU time, `wall_s`
    wall-clock time, `memory_mb` the child's address space; output past `max_output_chars` characters is cut off.
    """
    if not isinstance(code, str):
        return _failed(f"the code must be text, got {type(code).__name__}")
    limits = _Limits(cpu_s, wall_s, memory_mb, max_output_chars)
    try:
        with tempfile.TemporaryDirectory(prefix="python-tool-", ignore_cleanup_errors=True) as folder:
            return _run_in(os.path.realpath(folder), code.encode("utf-8", "surrogatepass"), limits)
    except OSError as exc:  # the machine's fault (no folder, descriptor or process to be had), not the code's
        return _failed(f"the python tool could not run: {exc}")


def _failed(error: str) -> SandboxResult:
    return SandboxResult(output="", error=error, timed_out=False, truncated=False)


# ---- the parent's side ----

class _Output:
    """The child's output as it arrives: the first `limit` characters are kept, the rest only counted."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen_chars = 0
        self._kept: list[str] = []
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, chunk: bytes, final: bool = False) -> None:
        text = self._decoder.decode(chunk, final)
        room = self.limit - self.seen_chars
        if room > 0:
            self._kept.append(text[:room])
        self.seen_chars += len(text)

    @property
    def truncated(self) -> bool:
        return self.seen_chars > self.limit

    @property
    def flooding(self) -> bool:
        return self.seen_chars > self.limit + _FLOOD_MARGIN_CHARS

    def text(self) -> str:
        kept = "".join(self._kept)
        if not self.truncated:
            return kept
        separator = "" if kept.endswith("\n") else "\n"
        return f"{kept}{separator}... (output truncated at {self.limit} characters)"


def _run_in(folder: str, code: bytes, limits: _Limits) -> SandboxResult:
    error_read, error_write = os.pipe()
    with open(error_read, "rb", buffering=0) as errors:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-u", os.path.abspath(__file__), str(error_write), repr(limits.cpu_s),
                 str(limits.memory_mb)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0, cwd=folder,
                env=_child_environment(folder), pass_fds=(error_write,), process_group=0)
        finally:
            os.close(error_write)  # the child has its own copy
        with proc:  # closes the pipes however this ends; its wait returns at once after _reap
            output = _Output(limits.max_output_chars)
            try:
                ending = _follow(proc, code, time.monotonic() + limits.wall_s, output)
            finally:
                _stop(proc.pid)
            if ending != "flooded":
                _drain(proc.stdout.fileno(), output)
            output.add(b"", final=True)
            exit_code, cpu_used = _reap(proc)
        return _result(output, ending, exit_code, cpu_used, _read_error_line(errors.fileno()), limits)


def _child_environment(folder: str) -> dict[str, str]:
    """Nothing of the parent's: no credentials, paths or settings leak into the code's reach. TMPDIR points
    tempfile at the working folder, the one place the code may write."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
            "TMPDIR": folder}


def _follow(proc: subprocess.Popen, code: bytes, deadline: float, output: _Output) -> str:
    """Feeds the code to the child and collects its output until the child exits, prints far past the limit or
    reaches the deadline; returns which: "exited", "flooded" or "timed out"."""
    stdin, stdout = proc.stdin.fileno(), proc.stdout.fileno()
    os.set_blocking(stdin, False)
    pending = memoryview(code)
    with selectors.DefaultSelector() as selector:
        selector.register(stdout, selectors.EVENT_READ, "output")
        selector.register(stdin, selectors.EVENT_WRITE, "input")
        while not _has_exited(proc.pid):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timed out"
            for key, _ in selector.select(min(remaining, _POLL_S)):
                if key.data == "input":
                    pending = _feed(stdin, pending)
                    if not pending:
                        selector.unregister(stdin)
                        proc.stdin.close()
                elif not _read_into(stdout, output):
                    selector.unregister(stdout)
                elif output.flooding:
                    return "flooded"
    return "exited"


def _has_exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (see _stop on why that matters)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # something else in this process reaped it
        return True


def _feed(stdin: int, pending: memoryview) -> memoryview:
    """What is left of `pending` after writing what the pipe takes now; nothing once the child stopped reading."""
    try:
        return pending[os.write(stdin, pending):]
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        return pending[:0]


def _read_into(fd: int, output: _Output) -> bool:
    """Reads one chunk into `output`; False at the end of the output."""
    chunk = os.read(fd, _CHUNK_BYTES)
    output.add(chunk)
    return bool(chunk)


def _drain(stdout: int, output: _Output) -> None:
    """Reads what the killed group left in the pipe. Bounded in time: a process outside the group could still
    hold the pipe open."""
    deadline = time.monotonic() + _DRAIN_S
    with selectors.DefaultSelector() as selector:
        selector.register(stdout, selectors.EVENT_READ)
        while not output.flooding and (remaining := deadline - time.monotonic()) > 0:
            if selector.select(remaining) and not _read_into(stdout, output):
                return


def _stop(pid: int) -> None:
    """Ends the child and everything it started, before the child is reaped: while it is a zombie its id cannot
    be reused, so the group kill cannot reach an unrelated process group.

    A child still running is first sent SIGTERM, on which the process the child handed the code to is killed, and
    with it the code's whole PID namespace, and reaped: killing the group at once would orphan that process, and
    a container's first process, which orphans go to, may never reap it.
    """
    if not _has_exited(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_S
        while not _has_exited(pid) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _reap(proc: subprocess.Popen) -> tuple[int | None, float]:
    """The child's exit code (negative: the signal that ended it) and the CPU seconds it used; no exit code when
    something else in this process reaped it first."""
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except ChildProcessError:
        proc.returncode = 0  # it is gone; Popen must not wait for it again
        return None, 0.0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _read_error_line(errors: int) -> str | None:
    """The line the child wrote after the last NUL byte: the code can write to the pipe too, but the child's own
    line comes after anything the code wrote."""
    os.set_blocking(errors, False)
    data = b""
    with contextlib.suppress(BlockingIOError):  # a process that escaped the group kill still holds the pipe
        while chunk := os.read(errors, _CHUNK_BYTES):
            data += chunk
    _, separator, line_bytes = data.rpartition(b"\0")
    line = line_bytes.decode("utf-8", "replace").strip() if separator else ""
    if len(line) > _MAX_ERROR_CHARS:
        line = line[:_MAX_ERROR_CHARS] + "..."
    return line or None


def _result(output: _Output, ending: str, exit_code: int | None, cpu_used: float, error_line: str | None,
            limits: _Limits) -> SandboxResult:
    timed_out = ending == "timed out" or _hit_cpu_limit(ending, exit_code, cpu_used, limits.cpu_s)
    if ending == "flooded":
        error = f"output limit exceeded: the program printed more than {limits.max_output_chars} characters and " \
                "was stopped"
    elif ending == "timed out":
        error = f"timed out after {limits.wall_s:g} s"
    elif timed_out:
        error = f"CPU time limit of {limits.cpu_s:g} s exceeded"
    elif error_line is not None and error_line.startswith("MemoryError"):
        error = f"MemoryError: the memory limit of {limits.memory_mb} MB was exceeded"
    elif error_line is not None:
        error = error_line
    elif exit_code is not None and exit_code < 0:
        error = f"the program was stopped by signal {signal.Signals(-exit_code).name}"
    elif exit_code:
        error = f"the program exited with status {exit_code}"
    else:
        error = None
    return SandboxResult(output=output.text(), error=error, timed_out=timed_out, truncated=output.truncated)


def _hit_cpu_limit(ending: str, exit_code: int | None, cpu_used: float, cpu_s: float) -> bool:
    """The kernel's SIGKILL at the CPU limit: a SIGKILL the parent did not send, after the CPU time was used."""
    killed = ending == "exited" and exit_code == -signal.SIGKILL
    return killed and cpu_used >= math.ceil(cpu_s) - _CPU_ACCOUNTING_SLACK_S


# ---- the child's side ----

def _child_main() -> None:
    error_fd, cpu_s, memory_mb = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    sys.argv = [""]
    code = sys.stdin.buffer.read().decode("utf-8", "surrogatepass")
    _limit_resources(cpu_s, memory_mb)
    if _isolate():
        _hand_over_to_first_process()
    _install_guards(os.getcwd())
    _run_code(code, error_fd)


def _isolate() -> bool:
    """Enters new network and PID namespaces, inside a new user namespace where that needs no privilege: no
    network interface but a loopback that is down, and no process outside in sight to signal or trace. False
    where the kernel permits neither; the audit hook then stands alone."""
    libc = ctypes.CDLL(None, use_errno=True)
    return any(libc.unshare(flags) == 0 for flags in (_CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWPID,
                                                       _CLONE_NEWNET | _CLONE_NEWPID))


def _hand_over_to_first_process() -> None:
    """Forks the process that runs the code, the first of the new PID namespace (a namespace is entered by the
    children of the process that made it). This one waits and ends as that one ended, so the parent sees its exit
    status, the signal that killed it and its CPU time; on SIGTERM from the parent it kills that process, which
    takes the namespace with it, and still reaps it (see _stop)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # held until the handler knows the process
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        return

    def kill_the_namespace(*_: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    signal.signal(signal.SIGTERM, kill_the_namespace)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    exit_code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if exit_code < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's handler cannot be set, nor need be
            signal.signal(-exit_code, signal.SIG_DFL)
        os.kill(os.getpid(), -exit_code)
    os._exit(exit_code)


def _limit_resources(cpu_s: float, memory_mb: int) -> None:
    # One CPU limit, enforced by SIGKILL: the code runs as the first process of its PID namespace, which the
    # kernel spares SIGXCPU's default action, so a soft limit below the hard one would only delay the end.
    cpu = math.ceil(cpu_s)
    _lower(resource.RLIMIT_CPU, cpu, cpu)
    _lower(resource.RLIMIT_AS, memory_mb * _MIB, memory_mb * _MIB)
    _lower(resource.RLIMIT_FSIZE, _FILE_SIZE_LIMIT, _FILE_SIZE_LIMIT)
    _lower(resource.RLIMIT_CORE, 0, 0)


def _lower(limit: int, soft: int, hard: int) -> None:
    """Sets a limit, never above the hard limit already in force (raising it would fail)."""
    _, current_hard = resource.getrlimit(limit)
    if current_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, current_hard), min(hard, current_hard)
    resource.setrlimit(limit, (soft, hard))


def _run_code(code: str, error_fd: int) -> None:
    """Runs the code as the __main__ module, writes the last line of an exception it raised to `error_fd`, out of
    reach of its prints, and exits at once: threads it left running and its atexit functions get no say after."""
    # Bound before the code runs, which may rebind builtins and module attributes.
    kind, describe, write, exit_now, suppress = type, traceback.format_exception_only, os.write, os._exit, \
        contextlib.suppress
    flushes = (sys.__stdout__.flush, sys.__stderr__.flush)
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main  # its own, so that pickle and dataclasses find the classes it defines
    failure = _exec(code, main.__dict__)
    if failure is not None:
        main.__dict__.clear()  # frees what the code held (after a MemoryError, everything), so formatting works
        try:
            line = describe(kind(failure), failure)[-1].strip()
        except BaseException:  # the code broke what formatting needs
            line = kind(failure).__name__
        write(error_fd, b"\0" + line.encode("utf-8", "replace"))
    for flush in flushes:
        with suppress(BaseException):
            flush()
    exit_now(0 if failure is None else 1)


def _exec(code: str, namespace: dict) -> BaseException | None:
    """The exception the code raised, without its traceback; None when it ended normally or by SystemExit(0)."""
    reserve = bytearray(_MEMORY_RESERVE_BYTES)
    try:
        exec(compile(code, "<tool>", "exec"), namespace)
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            return None
        failure: BaseException = exc
    except BaseException as exc:
        failure = exc
    else:
        return None
    del reserve  # room to describe a MemoryError in
    return BaseException.with_traceback(failure, None)


# ---- the child's guards ----
# Each guard function takes everything its decisions depend on (functions, event sets, the folders) as keyword
# defaults, bound before the model's code runs. That code can rebind module globals, builtins and closure cells
# without an audit event; reading, replacing or deleting a function's defaults or code raises one, which the guard
# refuses for its own functions.

_NETWORK = "network access is not allowed in the python tool"
_PROCESSES = "starting processes is not allowed in the python tool"
_SIGNALS = "sending signals is not allowed in the python tool"
_CTYPES = "calling C code through ctypes is not allowed in the python tool"
_REFUSED = (
    (frozenset({"subprocess.Popen", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty",
                "pty.spawn"}), _PROCESSES),
    (frozenset({"os.kill", "os.killpg"}), _SIGNALS),
    (frozenset({"os.link", "os.symlink"}), "creating links is not allowed in the python tool"),
    (frozenset({"resource.setrlimit", "resource.prlimit"}),
     "changing resource limits is not allowed in the python tool"),
    # A second interpreter in the same process starts without the audit hook.
    (frozenset({"cpython.PyInterpreterState_New"}),
     "starting another interpreter is not allowed in the python tool"),
    (frozenset({"sqlite3.enable_load_extension", "sqlite3.load_extension"}),
     "loading SQLite extensions is not allowed in the python tool"),
    # The objects these reach include the guards' defaults; tracing would let the code rewrite their locals.
    (frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.settrace", "sys.setprofile"}),
     "inspecting or tracing the interpreter is not allowed in the python tool"),
)
# cffi calls any C function, which can undo every guard (ctypes is loaded already, for _isolate, so that packages
# that only use its types, such as sympy, import; its calls raise ctypes.* events). _install_guards replaces
# functions of the other three that act without an audit event; a second copy of the module would bring them back.
_REFUSED_IMPORTS = frozenset({"_cffi_backend", "_posixsubprocess", "posix", "_signal"})
_CHANGES = frozenset({"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.utime", "os.truncate",
                      "os.setxattr", "os.removexattr", "shutil.rmtree"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_GUARDED_ATTRIBUTES = frozenset({"__code__", "__defaults__", "__kwdefaults__"})


def _resolved(path: object, *, getcwd=os.getcwd, fspath=os.fspath, type_=type, int_=int, is_instance=isinstance,
              bytes_=bytes, decode=bytes.decode, text=str.__str__) -> str | None:
    """`path` as an absolute path with "." and ".." resolved by name, or None for an open file descriptor.

    Links are not followed: the code cannot make any and its folder starts empty, so names decide. A relative
    path that climbs with ".." comes back as it is, inside no folder: with a folder's descriptor as `dir_fd`
    (which the event does not show) it would lead elsewhere than from the current folder. Subclasses of str and
    bytes are read through the base type's own methods, which they cannot override.
    """
    if type_(path) is int_:
        return None
    path = fspath(path)
    path = decode(path, "utf-8", "surrogateescape") if is_instance(path, bytes_) else text(path)
    if not path.startswith("/"):
        if ".." in path.split("/"):
            return path
        path = getcwd() + "/" + path
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            del parts[-1:]
        elif part and part != ".":
            parts.append(part)
    return "/" + "/".join(parts)


def _check_open(path: object, flags: int, *, writable: tuple[str, ...] = (), readable: tuple[str, ...] = (),
                resolved=_resolved, stat_=os.stat, devnull=os.devnull, write_flags=_WRITE_FLAGS,
                is_dir=stat.S_ISDIR, is_char=stat.S_ISCHR, is_block=stat.S_ISBLK) -> None:
    """Refuses writing outside the working folder, reading outside it and the installation, opening a folder
    outside it, and any device but os.devnull."""
    target = resolved(path)
    if target is None or target == devnull:
        return
    try:
        mode = stat_(target).st_mode
    except OSError:
        mode = 0
    if is_char(mode) or is_block(mode):
        raise PermissionError(f"opening the device {path!r} is not allowed in the python tool")
    if (target + "/").startswith(writable):
        return
    if flags & write_flags:
        raise PermissionError(f"writing {path!r} is not allowed in the python tool: write files in the working "
                              "folder")
    # A folder's descriptor, given as dir_fd, would let a name that looks inside the working folder write
    # outside it.
    if is_dir(mode) or not (target + "/").startswith(readable):
        raise PermissionError(f"reading {path!r} is not allowed in the python tool: only the working folder and "
                              "Python's own files can be read")


def _check_place(verb: str, path: object, roots: tuple[str, ...], *, resolved=_resolved) -> None:
    """Refuses `verb` on `path` unless it lies in one of `roots`. A file descriptor passes for listing and
    changing to a folder (only the working folder's folders can be opened) and fails for anything else."""
    target = resolved(path)
    if target is None and verb in ("listing", "changing to"):
        return
    if target is None or not (target + "/").startswith(roots):
        hint = "only the working folder and Python's own folders can be listed" if verb == "listing" \
            else "stay in the working folder"
        raise PermissionError(f"{verb} {path!r} is not allowed in the python tool: {hint}")


def _audit(event: str, args: tuple, *, writable: tuple[str, ...] = (), readable: tuple[str, ...] = (),
           guarded: tuple = (), check_open=_check_open, check_place=_check_place, refused=_REFUSED,
           refused_imports=_REFUSED_IMPORTS, changes=_CHANGES, guarded_attributes=_GUARDED_ATTRIBUTES,
           unix=socket.AF_UNIX, type_=type, text=str.__str__) -> None:
    """The audit hook: raises PermissionError (ImportError for a refused import) to stop an event."""
    if event == "open":
        check_open(args[0], args[2], writable=writable, readable=readable)
    elif event.startswith("socket.") and not (event == "socket.__new__" and args[1] == unix):
        # A Unix socket may be made (asyncio makes a pair to wake itself), but no socket can connect or bind.
        raise PermissionError(_NETWORK)
    elif event.startswith("ctypes."):
        raise PermissionError(_CTYPES)
    elif event == "import" and text(args[0]) in refused_imports:
        raise ImportError(f"importing {args[0]} is not allowed in the python tool", name=args[0])
    elif event in ("os.listdir", "os.scandir"):
        check_place("listing", "." if args[0] is None else args[0], writable + readable)
    elif event == "os.chdir":
        check_place("changing to", args[0], writable)
    elif event in changes:
        check_place("changing", args[0], writable)
    elif event == "os.rename":
        check_place("moving", args[0], writable)
        check_place("moving to", args[1], writable)
    elif event == "sqlite3.connect" and not (type_(args[0]) is str and args[0] in (":memory:", "")):
        # Refused whole: with uri=True, which the event does not show, a "file:" name can point anywhere.
        raise PermissionError("SQLite files are not allowed in the python tool: connect to ':memory:'")
    elif event.startswith("object.__") and text(args[1]) in guarded_attributes:
        for function in guarded:
            if args[0] is function:
                raise PermissionError("changing the python tool's guards is not allowed")
    else:
        for events, message in refused:
            if event in events:
                raise PermissionError(message)


def _install_guards(workdir: str) -> None:
    """Binds the folders into the guards and adds the audit hook; from here on the rules hold for good."""

    def refuse_process(*args: object) -> None:
        raise PermissionError(_PROCESSES)

    def refuse_signal(*args: object) -> None:
        raise PermissionError(_SIGNALS)

    # These raise no audit event. subprocess took its own copy of fork_exec when this module imported it; a pidfd
    # could signal the parent where no PID namespace hides it.
    _posixsubprocess.fork_exec = subprocess._fork_exec = refuse_process
    os.pidfd_open = posix.pidfd_open = signal.pidfd_send_signal = _signal.pidfd_send_signal = refuse_signal
    writable = (workdir.rstrip("/") + "/",)
    readable = _installation_dirs()
    _check_open.__kwdefaults__.update(writable=writable, readable=readable)
    _audit.__kwdefaults__.update(writable=writable, readable=readable,
                                 guarded=(_audit, _check_open, _check_place, _resolved, refuse_process, refuse_signal))
    sys.addaudithook(_audit)


def _installation_dirs() -> tuple[str, ...]:
    """The Python installation's folders (its prefixes, standard library and site-packages) and the time zone
    database zoneinfo reads, each ending in "/"; the root folder never, which would open everything."""
    time_zones = (sysconfig.get_config_var("TZPATH") or "").split(os.pathsep)
    dirs = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.__file__),
            *site.getsitepackages(), *time_zones}
    dirs |= {os.path.realpath(d) for d in dirs}
    return tuple(sorted(d.rstrip("/") + "/" for d in dirs if d.strip("/")))


if __name__ == "__main__":
    _child_main()
