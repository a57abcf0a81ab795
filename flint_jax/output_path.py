"""Writing an output safely: the destination rules that `convert`, `quantize` and `synth` share.

    with output_path.staging(dst, inputs=[("the source", src)], overwrite=ow, kind="dir") as tmp:
        ... write everything into tmp ...
    # here DST holds the complete output; on any exception (Ctrl-C included) nothing was changed

* **Refusals** (`check`), before anything is read or written: DST may not be an input (the
  source, `--hf-config`, `--config`, or any file directly inside an input directory, symlinks
  resolved: a HF cache's snapshot links into `blobs/`), may not contain one, and may not be the
  working directory or one of its parents. An existing DST needs `overwrite`, and is replaced only
  by an output of the same kind (a directory by a directory, a file by a file). Each refusal is a
  one-line `ValueError` / `FileExistsError` / `FileNotFoundError` naming DST and the reason.
* **Temporary sibling + rename**: the output is written to `.<DST name>.tmp-<host>-<pid>-<rand>`
  beside DST and renamed to DST once complete. With `overwrite`, the old DST is first renamed
  aside (`.<name>.old-...`), the new one renamed in, then the old one deleted: at every moment
  the complete old or new output is on disk. On any exception the temporary is removed.
* **Stale temporaries** of an earlier run that died (`kill -9`, a power cut) are found on the next
  run for the same DST: removed when they belong to a dead process of this host, named on stderr
  otherwise (and an `.old-` copy whose DST is missing, i.e. the only copy of the old output, is
  never removed: the note says how to restore it).
* **Modes**: directories and files are created with the modes the user's umask gives (not
  `mkdtemp`'s 0700 / `mkstemp`'s 0600).
* **Interrupts** (`interrupt_handler`, used by the CLI): the first SIGINT / SIGTERM silences
  stderr (no thread tracebacks from orbax / absl while the workers stop) and raises
  KeyboardInterrupt in the main thread; writers, worker threads included, also poll
  `interrupt_requested()` and stop (`checkpoint.write_params` stops orbax's writer and waits for
  its writes in flight, so nothing recreates the temporary after it is removed). The temporary is
  removed as the exception unwinds (`staging`), then `interrupted()` prints one line
  (`flint-jax convert: interrupted (nothing written)`) and ends the process with
  `os._exit(128 + signal)` (a thread still computing a tensor would otherwise delay the exit).
  A KeyboardInterrupt swallowed on its way (raised inside a garbage-collector callback, say) is
  raised again every 0.25 s until the cleanup starts; if it has not ended after `WATCHDOG_S`,
  the process ends anyway (the temporary then left is swept by the next run). A signal during
  the renames of a commit waits for them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator

KINDS = ("dir", "file")
# A temporary's or set-aside old output's name: .<DST name>.tmp-<host tag>-<pid>-<random>
_TAGGED = re.compile(r"(?P<host>[0-9a-f]{6})-(?P<pid>\d+)-(?P<rand>[0-9a-z]{8})")
# What earlier flint_jax versions left (mkdtemp / mkstemp names): named, never removed.
_LEGACY = re.compile(r"(tmp|old)-[0-9a-z_]{8}|[0-9a-z_]{8}\.tmp")
WATCHDOG_S = 5.0


class DestinationError(ValueError):
    """A destination flint_jax refuses to write (the message names it and says why)."""


def _note(msg: str) -> None:
    print(f"flint-jax: note: {msg}", file=sys.stderr, flush=True)


# ---- the refusal rules ---------------------------------------------------------------------------

def _forms(path: str) -> set[str]:
    return {os.path.abspath(path), os.path.realpath(path)}


def _within(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def _input_paths(label: str, path: str) -> list[tuple[str, str]]:
    """An input and, for a directory, the entries directly inside it (their symlinks resolved by
    `_forms`), each with a label for messages."""
    out = [(label, path)]
    if os.path.isdir(path):
        try:
            names = sorted(os.listdir(path))
        except OSError:
            names = []
        out += [(f"{name}, a file of {label}", os.path.join(path, name)) for name in names]
    return out


def normalize(dst: str | os.PathLike) -> str:
    """DST as given without trailing slashes or `/.` (`out/`, `out/.` and `out` name the same
    output); a DST ending in `..` (or `.` itself) becomes the directory it names, resolved."""
    dst = os.fspath(dst)
    while True:
        d = dst.rstrip(os.sep) or dst
        if d.endswith(os.sep + ".") and len(d) > 2:
            d = d[:-2]
        if d == dst:
            break
        dst = d
    if os.path.basename(dst) in (".", ".."):
        dst = os.path.realpath(dst)
    return dst


def check(dst: str | os.PathLike, *, inputs: Iterable[tuple[str, str | os.PathLike | None]] = (),
          overwrite: bool = False, kind: str = "dir", flag: str = "--overwrite") -> str:
    """Refuses DST (module docstring) or returns it normalized. `inputs`: (label, path) pairs,
    e.g. ("the source", src), ("--hf-config", dir); None paths are skipped. Touches nothing."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    dst = normalize(dst)
    dforms = _forms(dst)
    for label, path in inputs:
        if path is None:
            continue
        path = os.fspath(path)
        if not os.path.lexists(path):
            continue  # reported by the command that reads it
        for lab, p in _input_paths(label, path):
            pforms = _forms(p)
            if dforms & pforms:
                raise DestinationError(f"{dst}: the destination is {lab} ({p}); choose another "
                                       "output path")
            hit = next((d for d in dforms for q in pforms if _within(q, d)), None)
            if hit is not None:
                raise DestinationError(f"{dst}: the destination contains {lab} ({p}); writing it "
                                       "would replace its input: choose another output path")
    try:
        cwd = os.getcwd()
    except FileNotFoundError:  # the working directory was removed: it is no DST's child
        cwd = None
    for c in _forms(cwd) if cwd is not None else ():
        for d in dforms:
            if c == d:
                raise DestinationError(f"{dst}: the destination is the working directory; choose "
                                       "a new path for the output")
            if _within(c, d):
                raise DestinationError(f"{dst}: the destination contains the working directory "
                                       f"({cwd}); choose a new path for the output")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"{dst}: parent directory {parent} does not exist")
    if os.path.lexists(dst):
        if not overwrite:
            raise FileExistsError(f"{dst}: already exists (pass {flag} to replace it)")
        is_dir = os.path.isdir(dst)
        if kind == "dir" and not is_dir:
            raise DestinationError(f"{dst}: exists and is a file, and this output is a directory: "
                                   f"{flag} replaces a destination of the same kind only")
        if kind == "file" and os.path.isdir(dst):
            raise DestinationError(f"{dst}: exists and is a directory, and this output is a file: "
                                   f"{flag} replaces a destination of the same kind only")
    return dst


# ---- temporaries ---------------------------------------------------------------------------------

def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:6]


def sibling(dst: str, what: str) -> str:
    """A fresh name `.<DST name>.<what>-<host>-<pid>-<rand>` beside DST."""
    parent, base = os.path.split(os.path.abspath(dst))
    rand = "".join(secrets.choice("0123456789abcdefghijklmnopqrstuvwxyz") for _ in range(8))
    return os.path.join(parent, f".{base}.{what}-{_host_tag()}-{os.getpid()}-{rand}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def stale(dst: str) -> list[tuple[str, str, int | None]]:
    """Leftovers of earlier runs beside DST: (path, "tmp" or "old", pid or None)."""
    parent, base = os.path.split(os.path.abspath(dst))
    out = []
    try:
        names = os.listdir(parent)
    except OSError:
        return out
    for name in sorted(names):
        for what in ("tmp", "old"):
            pre = f".{base}.{what}-"
            if name.startswith(pre) and _TAGGED.fullmatch(name[len(pre):]):
                m = _TAGGED.fullmatch(name[len(pre):])
                pid = int(m["pid"]) if m["host"] == _host_tag() else None
                out.append((os.path.join(parent, name), what, pid))
        if name.startswith(f".{base}.") and _LEGACY.fullmatch(name[len(base) + 2:]):
            out.append((os.path.join(parent, name), "old" if ".old-" in name else "tmp", None))
    return out


def sweep(dst: str) -> None:
    """Removes stale temporaries of DST left by dead processes of this host; names the others."""
    for path, what, pid in stale(dst):
        if pid == os.getpid() or (pid is not None and _alive(pid)):
            _note(f"{path} belongs to a running process (pid {pid}) also writing {dst}")
            continue
        if what == "old" and not os.path.lexists(dst):
            _note(f"{path} holds the previous {dst}, set aside by an interrupted --overwrite run "
                  f"and not restored: rename it back to {dst}, or delete it")
            continue
        if pid is None:
            _note(f"{path} was probably left by an interrupted flint-jax run (another host or "
                  "an older version); delete it if nothing is writing "
                  f"{os.path.basename(dst)}")
            continue
        remove(path)
        _note(f"removed {path}, left by an interrupted run (pid {pid})")


def remove(path: str, attempts: int = 50) -> None:
    """Removes a file or tree; also outlasts a straggling background write that recreates a
    subdirectory right after it was removed."""
    for _ in range(attempts):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):  # (what cannot be removed is reported by the caller)
                os.unlink(path)
        if not os.path.lexists(path):
            time.sleep(0.02)
            if not os.path.lexists(path):
                return
        time.sleep(0.05)


def make_dir(path: str) -> str:
    """mkdir with the umask's mode (what `mkdtemp` does not give)."""
    os.mkdir(path)
    return path


def make_file(path: str) -> str:
    """An empty new file with the umask's mode (what `mkstemp` does not give)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return path


# ---- staging -------------------------------------------------------------------------------------

_STATE: dict = {"installed": False, "committed": [], "signal": None, "handled": False, "defer": 0,
                "pending": None, "stderr": None, "bar": False, "cmd": "flint-jax", "left": []}


@contextlib.contextmanager
def _deferred_interrupts():
    """While the renames of a commit run, a signal caught by `interrupt_handler` waits for them."""
    _STATE["defer"] += 1
    try:
        yield
    finally:
        _STATE["defer"] -= 1
        if not _STATE["defer"] and _STATE["pending"] is not None:
            signum, _STATE["pending"] = _STATE["pending"], None
            _start_interrupt(signum)
            raise KeyboardInterrupt


def commit(tmp: str, dst: str) -> None:
    """Moves the complete output `tmp` to DST; an existing DST is renamed aside first and deleted
    after the new one is in place."""
    old = None
    try:
        with _deferred_interrupts():
            if os.path.lexists(dst):
                old = sibling(dst, "old")
                os.rename(dst, old)
                try:
                    os.rename(tmp, dst)
                except BaseException:
                    os.rename(old, dst)
                    old = None
                    raise
            else:
                os.rename(tmp, dst)
            if _STATE["installed"]:
                _STATE["committed"].append(dst)
    finally:
        if old is not None:
            remove(old)


@contextlib.contextmanager
def staging(dst: str | os.PathLike, *, inputs: Iterable[tuple[str, str | os.PathLike | None]] = (),
            overwrite: bool = False, kind: str = "dir", flag: str = "--overwrite") -> Iterator[str]:
    """Checks DST (`check`), sweeps stale temporaries, and yields a new temporary sibling (an empty
    directory, or an empty file for kind="file"); on a normal exit renames it to DST (`commit`),
    on any exception removes it."""
    dst = check(dst, inputs=list(inputs), overwrite=overwrite, kind=kind, flag=flag)
    sweep(dst)
    tmp = sibling(dst, "tmp")
    try:
        make_dir(tmp) if kind == "dir" else make_file(tmp)
        yield tmp
        check_interrupt()
        commit(tmp, dst)
    except BaseException:
        handling()
        remove(tmp)
        if os.path.lexists(tmp):
            if _STATE["installed"]:
                _STATE["left"].append(tmp)
            _note(f"could not remove the temporary {tmp}; delete it (the next run for {dst} "
                  "also will)")
        raise


# ---- interrupts (the CLI) ------------------------------------------------------------------------

def interrupt_requested() -> bool:
    """True once `interrupt_handler` caught a signal: writers (threads too) poll it and stop."""
    return _STATE["signal"] is not None


def check_interrupt() -> None:
    """Raises KeyboardInterrupt if a signal was caught (for loops in the main thread, in case the
    first KeyboardInterrupt was swallowed, e.g. raised inside a garbage-collector callback)."""
    if _STATE["signal"] is not None and not _STATE["handled"]:
        raise KeyboardInterrupt


def handling() -> None:
    """Called where a BaseException is being handled (cleanup begins): no more KeyboardInterrupts
    are raised into the main thread after that."""
    if _STATE["signal"] is not None:
        _STATE["handled"] = True


def _silence() -> None:
    """Sends everything further written to stderr (thread tracebacks, log lines, progress bars)
    to /dev/null; `interrupted()` writes its one line to the saved stderr."""
    logging.disable(logging.CRITICAL)
    if _STATE["stderr"] is not None:
        return
    try:
        _STATE["bar"] = _bar_active()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        _STATE["stderr"] = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    except OSError:
        pass


def _message(cmd: str, writes: bool = True) -> str:
    if not writes:
        return f"{cmd}: interrupted"
    done = _STATE["committed"]
    what = f"{', '.join(done)} was written" if done else "nothing written"
    left = f"; could not remove {', '.join(_STATE['left'])}" if _STATE["left"] else ""
    return f"{cmd}: interrupted ({what}){left}"


def _bar_active() -> bool:
    """Whether a tqdm progress bar is open (its line has no newline yet)."""
    tqdm = sys.modules.get("tqdm.std")
    return bool(tqdm and len(getattr(tqdm.tqdm, "_instances", ())))


def _write_line(text: str) -> None:
    # A progress bar (and the terminal's "^C") may hold the current line: clear it on a
    # terminal, end it elsewhere. Without a caught signal (a KeyboardInterrupt outside
    # `interrupt_handler`, e.g. while a non-writing command loads) stderr was never silenced.
    fd = _STATE["stderr"]
    bar = _STATE["bar"] if fd is not None else _bar_active()
    if fd is None:
        tty = getattr(sys.stderr, "isatty", lambda: False)()
        print(("\r\033[K" if tty else "\n" if bar else "") + text, file=sys.stderr, flush=True)
        return
    lead = "\r\033[K" if os.isatty(fd) else "\n" if bar else ""
    with contextlib.suppress(OSError):
        os.write(fd, (lead + text + "\n").encode())


def _watchdog(signum: int) -> None:
    """After a signal: raises KeyboardInterrupt into the main thread again until it is handled
    (the first one may have been swallowed); ends the process if the cleanup takes too long."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < WATCHDOG_S:
        time.sleep(0.25)
        if not _STATE["handled"]:
            import _thread
            with contextlib.suppress(Exception):
                _thread.interrupt_main(signal.SIGINT)
    _write_line(_message(_STATE["cmd"]) + "; the cleanup did not finish in time, a temporary "
                "'.*.tmp-*' may remain beside the output (the next run removes it)")
    os._exit(128 + signum)


def _start_interrupt(signum: int) -> None:
    if _STATE["signal"] is not None:
        return
    _STATE["signal"] = signum
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _silence()
    threading.Thread(target=_watchdog, args=(signum,), daemon=True,
                     name="flint-interrupt").start()


def _on_signal(signum, frame):
    if _STATE["defer"]:
        _STATE["pending"] = _STATE["pending"] or signum
        return
    if _STATE["handled"]:
        return  # cleaning up: further Ctrl-C are ignored
    _start_interrupt(signum)
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupt_handler(cmd: str, enabled: bool = True) -> Iterator[None]:
    """Installs the SIGINT / SIGTERM handling of the module docstring for a writing command
    (main thread only; otherwise, or with enabled=False, Python's default behaviour)."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    _STATE.update(installed=True, committed=[], signal=None, pending=None, handled=False, cmd=cmd,
                  left=[])
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in old:
        signal.signal(s, _on_signal)
    try:
        yield
    finally:
        _STATE["installed"] = False
        for s, h in old.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(s, h)


def interrupted(cmd: str, writes: bool = True) -> int:
    """Reports an interrupt in one line (for a writing command: what was written). After a real
    signal caught by `interrupt_handler`, ends the process at once (`os._exit(128 + signal)`);
    otherwise returns 130."""
    handling()
    _write_line(_message(cmd, writes))
    signum = _STATE["signal"]
    if signum is not None:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(128 + signum)
    return 130


__all__ = ["DestinationError", "check", "check_interrupt", "commit", "handling",
           "interrupt_handler", "interrupt_requested", "interrupted", "remove", "staging", "stale",
           "sweep"]
